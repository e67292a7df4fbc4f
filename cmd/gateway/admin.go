package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/config"
	"github.com/rungworks/gateway/store"
)

// databaseHelp is the part of every operator command's help about the database.
const databaseHelp = `
The database is DATABASE_URL (postgres://user:password@host:5432/db). When it is
unset and the current folder holds the data folder of gateway dev (.gateway/),
the dev database is used (gateway dev must be running).`

// devDataDir is the data folder gateway dev uses by default.
const devDataDir = ".gateway"

// databaseURLFile names the file in the dev data folder that holds the dev
// database's connection string, for the operator commands to find.
const databaseURLFile = "database-url"

// withStore runs fn with a store over DATABASE_URL, or over the dev database
// when it is unset in a folder holding .gateway/ (no migrations applied),
// its sessions named after cmd.
func withStore(cmd *cobra.Command, fn func(*store.Store) error) error {
	ctx, stderr := cmd.Context(), cmd.ErrOrStderr()
	cfg, err := config.Load()
	if err != nil {
		return err
	}
	dev := false
	if cfg.DatabaseURL == "" {
		raw, err := os.ReadFile(filepath.Join(devDataDir, databaseURLFile))
		if err != nil {
			return errors.New("DATABASE_URL is required: set it to your PostgreSQL (postgres://user:password@host:5432/db), or run this in the folder where gateway dev (make run) keeps .gateway/")
		}
		cfg.DatabaseURL, dev = strings.TrimSpace(string(raw)), true
		fmt.Fprintf(stderr, "DATABASE_URL is unset: using the dev database of %s/ (%s)\n", devDataDir, cfg.DatabaseURL)
	}
	pool, err := store.Connect(ctx, cfg.DatabaseURL, cmd.CommandPath(), 0)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := pool.Ping(ctx); err != nil {
		if dev {
			return fmt.Errorf("the dev database does not answer; is gateway dev (make run) running? %w", err)
		}
		return fmt.Errorf("error connecting to PostgreSQL (DATABASE_URL): %w", err)
	}
	return fn(store.New(pool))
}

func migrateCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "migrate",
		Short: "Apply pending migrations and exit",
		Long:  "Applies pending migrations, under a PostgreSQL advisory lock, and exits.\n" + databaseHelp,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withStore(cmd, func(st *store.Store) error {
				n, err := store.Migrate(cmd.Context(), st.Pool())
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "applied %d migration(s)\n", n)
				return nil
			})
		},
	}
}

func keysCmd() *cobra.Command {
	keys := &cobra.Command{Use: "keys", Short: "Issue, list, rotate and revoke API keys", Long: "Issues, lists, rotates and revokes API keys.\n" + databaseHelp}

	var p store.CreateKeyParams
	var tier, scopes, expires string
	create := &cobra.Command{
		Use:   "create",
		Short: "Create a key (account and project are created on first use); prints the key alone",
		Long:  "Creates a key and prints it alone on stdout (it is shown once). The account and the project are created on first use.\n" + databaseHelp,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("tier") {
				t := gateway.Tier(tier)
				p.Tier = &t
			}
			var err error
			if p.ExpiresAt, err = expiresFlag(expires); err != nil {
				return err
			}
			for _, s := range strings.Split(scopes, ",") {
				if s = strings.TrimSpace(s); s != "" {
					p.Scopes = append(p.Scopes, gateway.Scope(s))
				}
			}
			return withStore(cmd, func(st *store.Store) error {
				token, err := st.CreateKey(cmd.Context(), p)
				if err != nil {
					return err
				}
				fmt.Fprintln(cmd.OutOrStdout(), token)
				return nil
			})
		},
	}
	create.Flags().StringVar(&p.Account, "account", "", "account name (required)")
	create.Flags().StringVar(&p.Project, "project", "default", "project name")
	create.Flags().StringVar(&tier, "tier", "developer", "account tier: free or developer (sets the tier of an existing account)")
	create.Flags().StringVar(&scopes, "scopes", "inference,usage", "comma-separated scopes: inference, usage")
	create.Flags().StringVar(&expires, "expires", "", "when the key stops being accepted: after a time (90d, 12h) or at one (2027-01-31, the start of that UTC day, or 2027-01-31T12:00:00Z); never by default")
	_ = create.MarkFlagRequired("account")

	var revokeAccount, revokeProject string
	revoke := &cobra.Command{
		Use:   "revoke KEY_PREFIX_OR_ID | --account A [--project P]",
		Short: "Revoke a key by its prefix (igw_xxxxxxxx) or id, or every key of an account or of one of its projects",
		Long: "Revokes a key, or with --account every active key of the account (with --project, of that project only), " +
			"to cut a tenant off at once: every replica refuses them from its next request. Its batches are not cancelled " +
			"(gateway batches cancel --account does that).\n" + databaseHelp,
		Args: cobra.MaximumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if (len(args) == 1) == (revokeAccount != "") || (revokeProject != "" && revokeAccount == "") {
				return errors.New("name a key (KEY_PREFIX_OR_ID) or an account (--account A, and --project P for one of its projects), not both")
			}
			return withStore(cmd, func(st *store.Store) error {
				if revokeAccount == "" {
					if err := st.RevokeKey(cmd.Context(), args[0]); err != nil {
						return err
					}
					fmt.Fprintln(cmd.ErrOrStderr(), "revoked")
					return nil
				}
				n, err := st.RevokeAccountKeys(cmd.Context(), revokeAccount, revokeProject)
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "revoked %d active key(s)\n", n)
				return nil
			})
		},
	}
	revoke.Flags().StringVar(&revokeAccount, "account", "", "revoke every active key of this account")
	revoke.Flags().StringVar(&revokeProject, "project", "", "with --account: only this project's keys")
	var grace, newExpires string
	rotate := &cobra.Command{
		Use:   "rotate KEY_PREFIX_OR_ID",
		Short: "Issue a key in place of another (same project and scopes), and end the old one after --grace; prints the new key alone",
		Long: "Issues a key with the project and scopes of an active one and prints it alone on stdout (it is shown once); " +
			"the old key is accepted for --grace more, or until its own end if sooner, so clients move to the new key without a refused request.\n" + databaseHelp,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			keep, err := parseSpan(grace)
			if err != nil {
				return fmt.Errorf("--grace: %w", err)
			}
			expires, err := expiresFlag(newExpires)
			if err != nil {
				return err
			}
			return withStore(cmd, func(st *store.Store) error {
				rotated, err := st.RotateKey(cmd.Context(), args[0], keep, expires)
				if err != nil {
					return err
				}
				fmt.Fprintln(cmd.OutOrStdout(), rotated.Token)
				fmt.Fprintf(cmd.ErrOrStderr(), "%s is accepted until %s\n", args[0], rotated.OldExpiresAt.UTC().Format(time.RFC3339))
				return nil
			})
		},
	}
	rotate.Flags().StringVar(&grace, "grace", "24h", "how long the old key is still accepted, in days (7d) or as a duration (12h; 0s: no longer)")
	rotate.Flags().StringVar(&newExpires, "expires", "", "when the new key stops being accepted, as for create; never by default")

	var account string
	list := &cobra.Command{
		Use:   "list",
		Short: "List keys (never their secrets), newest first, to find one to revoke",
		Long:  "Lists the keys, newest first: prefix, account, tier, project, scopes, when created, when it expires and when revoked, id.\n" + databaseHelp,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withStore(cmd, func(st *store.Store) error {
				found, err := st.ListKeys(cmd.Context(), account)
				if err != nil {
					return err
				}
				printKeys(cmd.OutOrStdout(), found)
				return nil
			})
		},
	}
	list.Flags().StringVar(&account, "account", "", "only this account's keys")
	keys.AddCommand(create, list, rotate, revoke)
	return keys
}

// maxSpanDays bounds a span given in days (a hundred years).
const maxSpanDays = 36500

// parseSpan reads a span of time: whole days (90d) or a duration (12h, 30m),
// not negative.
func parseSpan(v string) (time.Duration, error) {
	if days, ok := strings.CutSuffix(v, "d"); ok {
		if n, err := strconv.Atoi(days); err == nil && n >= 0 && n <= maxSpanDays {
			return time.Duration(n) * 24 * time.Hour, nil
		}
	} else if d, err := time.ParseDuration(v); err == nil && d >= 0 {
		return d, nil
	}
	return 0, fmt.Errorf("want days (7d) or a duration (12h, 30m), got %q", v)
}

// expiresFlag reads an --expires flag (see parseExpiry); nil when it is not
// given: the key never expires.
func expiresFlag(v string) (*time.Time, error) {
	if v == "" {
		return nil, nil
	}
	at, err := parseExpiry(v, time.Now())
	if err != nil {
		return nil, fmt.Errorf("--expires: %w", err)
	}
	return &at, nil
}

// parseExpiry reads --expires: a span from now (90d, 12h; see parseSpan), the
// start of a UTC day (YYYY-MM-DD), or an RFC 3339 time.
func parseExpiry(v string, now time.Time) (time.Time, error) {
	if d, err := parseSpan(v); err == nil && d > 0 {
		return now.Add(d), nil
	}
	if t, err := time.Parse(dayLayout, v); err == nil {
		return t, nil
	}
	if t, err := time.Parse(time.RFC3339, v); err == nil {
		return t, nil
	}
	return time.Time{}, fmt.Errorf("want a time from now (90d, 12h) or a time (2027-01-31, 2027-01-31T12:00:00Z), got %q", v)
}

// printKeys writes keys as a table, one key a line.
func printKeys(w io.Writer, keys []store.Key) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PREFIX\tACCOUNT\tTIER\tPROJECT\tSCOPES\tCREATED\tEXPIRES\tREVOKED\tID")
	when := func(t *time.Time) string {
		if t == nil {
			return "-"
		}
		return t.UTC().Format(time.RFC3339)
	}
	for _, k := range keys {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", k.Prefix, k.Account, k.Tier, k.Project,
			strings.Join(k.Scopes, ","), k.CreatedAt.UTC().Format(time.RFC3339), when(k.ExpiresAt), when(k.RevokedAt), k.ID)
	}
	_ = tw.Flush()
}

func limitsCmd() *cobra.Command {
	limits := &cobra.Command{Use: "limits", Short: "Set and show daily rung ceilings and project budgets", Long: "Sets and shows daily rung ceilings and project budgets.\n" + databaseHelp}
	var p store.SetLimitsParams
	var daily, budget string
	set := &cobra.Command{
		Use:   "set",
		Short: "Set an account's daily rung ceiling and/or a project's budget cap",
		Long: "Sets an account's daily rung ceiling (default: back to its tier's) and/or a project's budget cap (none: uncapped), " +
			"then shows the account's limits as limits show does. " +
			"The account and the project must exist (gateway keys create creates them).\n" + databaseHelp,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var err error
			if cmd.Flags().Changed("daily-rungs") {
				if p.DailyRungs, p.ClearDaily, err = parseLimit(daily, "default"); err != nil {
					return fmt.Errorf("--daily-rungs: %w", err)
				}
			}
			if cmd.Flags().Changed("budget-rungs") {
				if p.BudgetRungs, p.ClearBudget, err = parseLimit(budget, "none"); err != nil {
					return fmt.Errorf("--budget-rungs: %w", err)
				}
			}
			if !cmd.Flags().Changed("daily-rungs") && !cmd.Flags().Changed("budget-rungs") {
				return errors.New("nothing to set: give --daily-rungs and/or --budget-rungs")
			}
			return withStore(cmd, func(st *store.Store) error {
				if err := st.SetLimits(cmd.Context(), p); err != nil {
					return err
				}
				return showLimits(cmd, st, p.Account)
			})
		},
	}
	set.Flags().StringVar(&p.Account, "account", "", "account name (required)")
	set.Flags().StringVar(&daily, "daily-rungs", "", "daily rung ceiling of the account, or default (its tier's)")
	set.Flags().StringVar(&p.Project, "project", "default", "project whose budget to set")
	set.Flags().StringVar(&budget, "budget-rungs", "", "hard budget cap of the project in rungs, or none (uncapped)")
	_ = set.MarkFlagRequired("account")

	var account string
	show := &cobra.Command{
		Use:   "show",
		Short: "Show an account's daily ceiling and its projects' budgets, with what is charged against them",
		Long:  "Shows an account's daily rung ceiling with today's charge, and each of its projects' budget cap with what is spent and reserved.\n" + databaseHelp,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withStore(cmd, func(st *store.Store) error {
				return showLimits(cmd, st, account)
			})
		},
	}
	show.Flags().StringVar(&account, "account", "", "account name (required)")
	_ = show.MarkFlagRequired("account")
	limits.AddCommand(set, show)
	return limits
}

// parseLimit reads a limit flag: a whole number of rungs, or unset (the word
// that drops the limit).
func parseLimit(v, unset string) (rungs *int64, cleared bool, err error) {
	if v == unset {
		return nil, true, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return nil, false, fmt.Errorf("want a whole number of rungs (0 or more) or %s, got %q", unset, v)
	}
	return &n, false, nil
}

// showLimits prints the limits of account.
func showLimits(cmd *cobra.Command, st *store.Store, account string) error {
	l, err := st.Limits(cmd.Context(), account)
	if err != nil {
		return err // names the account when it does not exist
	}
	printLimits(cmd.OutOrStdout(), l)
	return nil
}

// printLimits writes an account's limits as two tables: the account's daily
// ceiling, then its projects' budgets.
func printLimits(w io.Writer, l *store.AccountLimits) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	ceiling := strconv.FormatInt(l.Daily.Ceiling, 10)
	if l.DailyDefault {
		ceiling += " (tier default)"
	}
	fmt.Fprintln(tw, "ACCOUNT\tTIER\tDAILY CEILING\tCHARGED TODAY\tREMAINING\tRESETS")
	fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\n", l.Account, l.Tier, ceiling, l.Daily.Charged, l.Daily.Remaining, l.Daily.ResetsAt.UTC().Format(time.RFC3339))
	_ = tw.Flush()
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PROJECT\tBUDGET CAP\tSPENT\tRESERVED\tREMAINING")
	for _, p := range l.Projects {
		limit, left := "none", "-"
		if p.Cap != nil {
			limit, left = strconv.FormatInt(*p.Cap, 10), strconv.FormatInt(max(0, *p.Cap-p.Spent-p.Reserved), 10)
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\n", p.Project, limit, p.Spent, p.Reserved, left)
	}
	_ = tw.Flush()
}
