package store_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/store"
)

// TestOldRequestsAreFoldedIntoDays: the requests completed before the
// retention's horizon are removed and added to their day's sums in the same
// statement, a few at a time, and the folded sums of the minutes before it
// are removed: the usage report, which reads the requests and the days, and
// the usage view over whole hours before the horizon and any times after it
// are what they were. The requests and minutes after the horizon stay, and
// evidence is held until its own expiry.
func TestOldRequestsAreFoldedIntoDays(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, acme := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, globex := b.key(t, "globex", gateway.TierDeveloper, gateway.ScopeInference)
	now := time.Now().UTC()
	horizon := now.Add(-90 * 24 * time.Hour)
	entries := []gateway.EntryPoint{gateway.EntryResponses, gateway.EntryChat, gateway.EntryBatch}
	models := []gateway.Model{gateway.ModelInstant, gateway.ModelReasoning}
	rng := rand.New(rand.NewPCG(3, 4))
	var old, kept []uuid.UUID
	var lastOld gateway.UsageRecord
	for i := range 60 {
		p := []*gateway.Principal{acme, globex}[i%2]
		// Over the eight days around the horizon, to the microsecond.
		completed := horizon.Add(time.Duration(rng.Int64N(int64(8*24*time.Hour))) - 4*24*time.Hour).Truncate(time.Microsecond)
		r := at(p, completed, models[i%len(models)], int64(2+i))
		r.Entry = entries[i%len(entries)]
		r.Sources = []gateway.Source{{Title: "source", URL: "https://example.com/" + r.RequestID.String()}}
		r.EvidenceExpiresAt = now.Add(time.Hour) // held past the fold, to see it stay until it expires
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: r}}))
		if completed.Before(horizon) {
			old, lastOld = append(old, r.RequestID), r
		} else {
			kept = append(kept, r.RequestID)
		}
	}
	require.NotEmpty(t, old)
	require.NotEmpty(t, kept)
	_, err := b.store.FoldUsageMinutes(b.ctx, now, 1000)
	require.NoError(t, err)

	first, end := gateway.UTCDay(horizon).AddDate(0, 0, -5), gateway.UTCDay(now).AddDate(0, 0, 1)
	// The whole range, and ranges ending at each midnight around the
	// horizon, whose end day's sums are no part of them.
	report := func() (out [][]store.UsageLine) {
		ends := []time.Time{end}
		for i := -3; i <= 5; i++ {
			ends = append(ends, gateway.UTCDay(horizon).AddDate(0, 0, i))
		}
		for _, last := range ends {
			lines, err := b.store.UsageReport(b.ctx, first, last, "")
			require.NoError(t, err)
			out = append(out, lines)
		}
		return out
	}
	hour := horizon.Truncate(time.Hour)
	periods := [][2]time.Time{
		{first, end}, {hour, end}, {first, hour.Add(-3 * time.Hour)},
		{hour.Add(-24 * time.Hour), hour.Add(2*time.Hour + 17*time.Minute + 3*time.Second)}, // a time after the horizon, inside a minute
	}
	views := func() (out []*gateway.UsageView) {
		for _, p := range []*gateway.Principal{acme, globex} {
			for _, period := range periods {
				v, err := b.store.Usage(b.ctx, p, period[0], period[1])
				require.NoError(t, err)
				out = append(out, v)
			}
		}
		return out
	}
	minutes := func(older bool) (rows int) {
		err := b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM usage_minutes WHERE (minute < $1) = $2`, horizon, older).Scan(&rows)
		require.NoError(t, err)
		return rows
	}
	lines, before, newer := report(), views(), minutes(false)
	require.Positive(t, before[0].Totals.Requests)
	require.Positive(t, minutes(true))
	require.Positive(t, newer)

	olderMinutes := minutes(true)
	var handled int64
	for {
		n, err := b.store.FoldOldUsage(b.ctx, horizon, 7)
		require.NoError(t, err)
		if n == 0 {
			break
		}
		require.LessOrEqual(t, n, int64(7))
		handled += n
	}
	require.Equal(t, int64(len(old)+olderMinutes), handled)
	require.Zero(t, minutes(true), "the minutes before the horizon are left to their hours")
	require.Equal(t, newer, minutes(false))
	var left int
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM requests WHERE id = ANY($1)`, old).Scan(&left))
	require.Zero(t, left)
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM requests WHERE id = ANY($1)`, kept).Scan(&left))
	require.Equal(t, len(kept), left, "the requests after the horizon stay")
	ev, err := b.store.Evidence(b.ctx, lastOld.Principal.AccountID, lastOld.RequestID)
	require.NoError(t, err, "evidence is held until it expires")
	require.Len(t, ev.Sources, 1)
	require.Equal(t, lines, report(), "the report reads the folded requests from their days")
	require.Equal(t, before, views(), "the view reads whole hours from their sums")
}

// TestOldUsageIsFoldedAFewAccountsARun: each run of the pass over usage past
// the retention looks at a window of accounts in order of id and handles at
// most its rows; it goes on where the last stopped, inside an account whose
// rows it did not finish, and starts over past the last account: every
// account's old usage is handled in a few runs, however many accounts there
// are, and none twice.
func TestOldUsageIsFoldedAFewAccountsARun(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	exec := func(sql string, args ...any) {
		_, err := b.store.Pool().Exec(b.ctx, sql, args...)
		require.NoError(t, err)
	}
	count := func(sql string, args ...any) (n int64) {
		require.NoError(t, b.store.Pool().QueryRow(b.ctx, sql, args...).Scan(&n))
		return n
	}
	// Accounts over more than two windows; acme's id, a version 7, sorts
	// near the start of them, the last one at the end.
	exec(`INSERT INTO accounts (id, name, tier) SELECT gen_random_uuid(), 'account ' || i, 'developer' FROM generate_series(1, 12000) i`)
	now := time.Now().UTC()
	horizon := now.Add(-90 * 24 * time.Hour)
	for i := range 4 {
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: at(p, horizon.Add(-time.Duration(i+1)*time.Hour), gateway.ModelInstant, 10)}}))
	}
	var last uuid.UUID
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT id FROM accounts ORDER BY id DESC LIMIT 1`).Scan(&last))
	exec(`INSERT INTO requests (id, account_id, project_id, model, entry_point, status,
	                            input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
	      SELECT gen_random_uuid(), $1, $2, 'reasoning', 'batch', 'completed', 1, 1, 1, 1, 2, t, t
	        FROM (SELECT $3::timestamptz - i * interval '1 day' AS t FROM generate_series(1, 3) i) g`, last, uuid.Must(uuid.NewV7()), horizon)
	settledNow := at(p, now, gateway.ModelInstant, 10) // kept
	require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: settledNow}}))
	_, err := b.store.FoldUsageMinutes(b.ctx, now.Add(time.Hour), 1000)
	require.NoError(t, err)
	old := func() int64 {
		return count(`SELECT count(*) FROM requests WHERE completed_at < $1`, horizon) +
			count(`SELECT count(*) FROM usage_minutes WHERE minute < $1`, horizon)
	}
	want := old()
	require.Equal(t, int64(4+3+4+3), want, "seven requests and their minutes")

	var handled int64
	runs := 0
	for handled < want && runs < 20 {
		n, err := b.store.FoldOldUsage(b.ctx, horizon, 5)
		require.NoError(t, err)
		require.LessOrEqual(t, n, int64(5))
		handled += n
		runs++
	}
	require.Equal(t, want, handled)
	// Three windows of accounts: acme's eight rows in the first two runs
	// (the second going on in acme), the second window in one, the last
	// account's six rows in two more.
	require.Equal(t, 5, runs)
	require.Zero(t, old())
	require.Equal(t, int64(1), count(`SELECT count(*) FROM requests`), "the request of now stays")
	for range 3 { // a whole pass more: nothing to do
		n, err := b.store.FoldOldUsage(b.ctx, horizon, 5)
		require.NoError(t, err)
		require.Zero(t, n)
	}
	require.Equal(t, int64(7), count(`SELECT sum(requests) FROM usage_days`))
}

// TestAFoldOfOldUsageTheDatabaseFailedGoesOnThere: a run the database
// fails (here a statement sent past its deadline) stops in the account it
// was folding, which is not set aside: the next run folds it. Only the
// steps due are sent: an account whose minutes were never folded has none
// to remove.
func TestAFoldOfOldUsageTheDatabaseFailedGoesOnThere(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	horizon := time.Now().UTC().Add(-90 * 24 * time.Hour)
	for i := range 2 {
		require.NoError(t, b.store.SettleRequests(b.ctx, []store.Settlement{{Record: at(p, horizon.Add(-time.Duration(i+1)*time.Hour), gateway.ModelInstant, 10)}}))
	}
	names := &statementNames{}
	late := &pastDeadline{statementNames: names, name: "name: FoldOldRequests"}
	traced := b.traced(t, late)
	_, err := traced.FoldOldUsage(b.ctx, horizon, 100)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.True(t, store.Transient(err))
	n, err := traced.FoldOldUsage(b.ctx, horizon, 100)
	require.NoError(t, err)
	require.Equal(t, int64(2), n, "the account was not set aside")
	require.NotContains(t, names.take(), "DeleteOldUsageMinutes", "no step that is not due")
}

// pastDeadline sends the first statement whose text holds name with its
// deadline passed, and records the names of all.
type pastDeadline struct {
	*statementNames
	name string
	done atomic.Bool
}

func (p *pastDeadline) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	ctx = p.statementNames.TraceQueryStart(ctx, conn, d)
	if strings.Contains(d.SQL, p.name) && p.done.CompareAndSwap(false, true) {
		ctx, cancel := context.WithDeadline(ctx, time.Now())
		_ = cancel // ends with the deadline, passed already
		return ctx
	}
	return ctx
}

// TestTheFoldReadsPastWhatItRemoved: the index entries of the requests the
// pass removed stay until a vacuum (autovacuum is off here, as it is for
// days on a large table); the pass reads each account's oldest request from
// where it stands there, a few pages, not through the entries of the 30,000
// it removed (some hundred pages).
func TestTheFoldReadsPastWhatItRemoved(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	now := time.Now().UTC()
	horizon := now.Add(-90 * 24 * time.Hour)
	_, err := b.store.Pool().Exec(b.ctx, `ALTER TABLE requests SET (autovacuum_enabled = off)`)
	require.NoError(t, err)
	_, err = b.store.Pool().Exec(b.ctx, `
		INSERT INTO requests (id, account_id, project_id, model, entry_point, status,
		                      input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
		SELECT gen_random_uuid(), $1, $2, 'instant', 'responses', 'completed', 1, 1, 1, 1, 2, t, t
		  FROM (SELECT $3::timestamptz - i * interval '1 second' AS t FROM generate_series(1, 30000) i
		        UNION ALL SELECT $4::timestamptz) g`, p.AccountID, p.ProjectID, horizon, now)
	require.NoError(t, err)
	var folded int64
	for {
		n, err := b.store.FoldOldUsage(b.ctx, horizon, 10_000)
		require.NoError(t, err)
		if n == 0 {
			break
		}
		folded += n
	}
	require.Equal(t, int64(30_000), folded)

	explained, plans := b.explained(t)
	_, err = explained.Pool().Exec(b.ctx, `SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on`)
	require.NoError(t, err)
	n, err := explained.FoldOldUsage(b.ctx, horizon, 10_000)
	require.NoError(t, err)
	require.Zero(t, n)
	probe := plansOf(t, plans(), []string{"-- name: OldUsageAccounts "})
	require.Len(t, probe, 1, "the probe was explained: %q", plans())
	read := regexp.MustCompile(`Index (?:Only )?Scan using requests_account_completed_idx on requests r[\s\S]*?Buffers: shared hit=(\d+)`).FindStringSubmatch(probe[0])
	require.NotNil(t, read, probe[0])
	pages, err := strconv.Atoi(read[1])
	require.NoError(t, err)
	require.Less(t, pages, 20, "pages read for the oldest request: %s", probe[0])
}

// TestExpiredEvidenceGoesEarliestFirst: a removal of expired evidence takes
// the earliest expiries first, whatever order the rows were written in and
// however PostgreSQL reads them (here without its indexes), so that the next
// run, reading from where it stopped, leaves none behind.
func TestExpiredEvidenceGoesEarliestFirst(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	_, err := b.store.Pool().Exec(b.ctx, `INSERT INTO evidence (request_id, account_id, sources, expires_at)
		SELECT gen_random_uuid(), $1, '[]', now() - i * interval '1 hour' FROM generate_series(1, 3) i`, p.AccountID)
	require.NoError(t, err)
	unindexed := b.unindexed(t)
	for range 3 {
		n, err := unindexed.DeleteExpiredEvidence(b.ctx, 1)
		require.NoError(t, err)
		require.Equal(t, int64(1), n)
	}
}

// TestOldUsageGoesEarliestFirst: the pass over usage past the retention
// folds an account's oldest requests first, and removes its oldest folded
// minutes first, whatever order the rows were written in and however
// PostgreSQL reads them (here without its indexes), so that the next run,
// reading from where the last stopped, leaves none behind; it finds them
// past a later row written before them, and passes over the minutes not
// yet folded into their hours, which stay for the fold.
func TestOldUsageGoesEarliestFirst(t *testing.T) {
	t.Parallel()
	b := setup(t)
	_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	now := time.Now().UTC()
	horizon := now.Add(-90 * 24 * time.Hour)
	// A row after the horizon written first, then the old ones, the latest
	// first, an hour apart; and a minute not folded before all of them.
	_, err := b.store.Pool().Exec(b.ctx, `
		INSERT INTO requests (id, account_id, project_id, model, entry_point, status,
		                      input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
		SELECT gen_random_uuid(), $1, $2, 'instant', 'responses', 'completed', 1, 1, 1, 1, 2, t, t
		  FROM (SELECT i, CASE WHEN i = 0 THEN $4 ELSE $3::timestamptz - i * interval '1 hour' END AS t
		          FROM generate_series(0, 3) i) g ORDER BY i`, p.AccountID, p.ProjectID, horizon, now)
	require.NoError(t, err)
	_, err = b.store.Pool().Exec(b.ctx, `
		INSERT INTO usage_minutes (account_id, minute, model, backend, requests, input_rungs, output_rungs, total_rungs)
		SELECT $1, t, 'instant', CASE WHEN i = 4 THEN 7 ELSE 0 END, 1, 1, 1, 2
		  FROM (SELECT i, CASE WHEN i = 0 THEN date_trunc('minute', $3::timestamptz)
		                       ELSE date_trunc('minute', $2::timestamptz) - i * interval '1 hour' END AS t
		          FROM generate_series(0, 4) i) g ORDER BY i`, p.AccountID, horizon, now)
	require.NoError(t, err)
	unfoldedMinutes := func() (n int64) {
		require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT count(*) FROM usage_minutes WHERE minute < $1 AND backend <> 0`, horizon).Scan(&n))
		return n
	}
	unfolded := unfoldedMinutes() // the one written, and those the requests added to
	require.Positive(t, unfolded)
	unindexed := b.unindexed(t)
	for run := range 6 { // three requests, then three minutes
		n, err := unindexed.FoldOldUsage(b.ctx, horizon, 1)
		require.NoError(t, err)
		require.Equal(t, int64(1), n, "run %d", run)
	}
	n, err := unindexed.FoldOldUsage(b.ctx, horizon, 1)
	require.NoError(t, err)
	require.Zero(t, n)
	var requests, days, folded int64
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `
		SELECT (SELECT count(*) FROM requests WHERE completed_at < $1),
		       (SELECT coalesce(sum(requests), 0) FROM usage_days),
		       (SELECT count(*) FROM usage_minutes WHERE minute < $1 AND backend = 0)`, horizon).Scan(&requests, &days, &folded))
	require.Zero(t, requests)
	require.Equal(t, int64(3), days)
	require.Zero(t, folded)
	require.Equal(t, unfolded, unfoldedMinutes(), "left for the fold into their hours")
}

// TestAFoldOfOldUsageRemovesItsAccountsRowsAlone: a run over usage past
// the retention removes, of each account it handles, that account's rows,
// never another's, however much older those are.
func TestAFoldOfOldUsageRemovesItsAccountsRowsAlone(t *testing.T) {
	t.Parallel()
	b := setup(t)
	b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
	b.key(t, "globex", gateway.TierDeveloper, gateway.ScopeInference)
	var first, second uuid.UUID
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT (array_agg(id ORDER BY id))[1], (array_agg(id ORDER BY id))[2] FROM accounts`).Scan(&first, &second))
	horizon := time.Now().UTC().Add(-90 * 24 * time.Hour).Truncate(time.Minute)
	// The first account's folded minute is newer than the second's.
	_, err := b.store.Pool().Exec(b.ctx, `
		INSERT INTO usage_minutes (account_id, minute, model, backend, requests, input_rungs, output_rungs, total_rungs)
		VALUES ($1, $3::timestamptz - interval '1 hour', 'instant', 0, 1, 1, 1, 2),
		       ($2, $3::timestamptz - interval '5 hours', 'instant', 0, 1, 1, 1, 2)`, first, second, horizon)
	require.NoError(t, err)
	n, err := b.store.FoldOldUsage(b.ctx, horizon, 1)
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	var left uuid.UUID
	require.NoError(t, b.store.Pool().QueryRow(b.ctx, `SELECT account_id FROM usage_minutes`).Scan(&left))
	require.Equal(t, second, left, "the run handled the first account")
}

// TestOldBatchesAndKeysGoEarliestFirst: the removal of old batches and the
// expiry of idempotency keys take the earliest first, whatever order the
// rows were written in and however PostgreSQL reads them (here without its
// indexes), so that the next run, reading from where the last stopped,
// leaves none behind.
func TestOldBatchesAndKeysGoEarliestFirst(t *testing.T) {
	t.Parallel()
	before := time.Now().UTC().Add(-30 * 24 * time.Hour)
	for _, c := range []struct {
		name, left string
		run        func(*store.Store) (int64, error)
	}{
		{"old batches", `SELECT count(*) FROM batches`,
			func(st *store.Store) (int64, error) { return st.DeleteOldBatches(context.Background(), before, 1) }},
		{"idempotency keys", `SELECT count(*) FROM batches WHERE idempotency_key IS NOT NULL`,
			func(st *store.Store) (int64, error) { return st.ExpireIdempotencyKeys(context.Background(), before, 1) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
			// The latest written first, an hour apart.
			_, err := b.store.Pool().Exec(b.ctx, `INSERT INTO batches (id, account_id, project_id, status, total_requests, idempotency_key, request_hash, created_at, completed_at, expires_at)
				SELECT gen_random_uuid(), $1, $2, 'completed', 1, 'key ' || i, '\x00', t, t, t
				  FROM (SELECT i, $3::timestamptz - i * interval '1 hour' AS t FROM generate_series(1, 3) i) g ORDER BY i`,
				p.AccountID, p.ProjectID, before)
			require.NoError(t, err)
			unindexed := b.unindexed(t)
			for range 3 {
				n, err := c.run(unindexed)
				require.NoError(t, err)
				require.Equal(t, int64(1), n)
			}
			var left int
			require.NoError(t, b.store.Pool().QueryRow(b.ctx, c.left).Scan(&left))
			require.Zero(t, left)
		})
	}
}

// TestRemovalsReadFromWhereTheyStopped: the jobs that remove (or clear) a
// table's oldest rows first — expired evidence, old batches, idempotency
// keys past the window — remove what is due a run at a time, and nothing
// else; then each run reads from where the last stopped (less a minute, for
// replicas' clocks), a few pages, not through the index entries of the
// 30,000 rows handled before, which stay until a vacuum (autovacuum is off
// here, as it is for days on a large table). A replica that starts reads
// from the start once.
func TestRemovalsReadFromWhereTheyStopped(t *testing.T) {
	t.Parallel()
	before := time.Now().UTC().Add(-30 * 24 * time.Hour)
	for _, c := range []struct {
		name, table, fill, left, statement string
		run                                func(*store.Store) (int64, error)
	}{
		{
			name: "expired evidence", table: "evidence", statement: "DeleteExpiredEvidence",
			fill: `INSERT INTO evidence (request_id, account_id, sources, expires_at)
			       SELECT gen_random_uuid(), $1, '[]', now() + i * interval '1 second' FROM generate_series(-29999, 1000) i`,
			left: `SELECT count(*) FROM evidence`,
			run:  func(st *store.Store) (int64, error) { return st.DeleteExpiredEvidence(context.Background(), 7000) },
		},
		{
			name: "old batches", table: "batches", statement: "DeleteOldBatches",
			fill: `INSERT INTO batches (id, account_id, project_id, status, total_requests, request_hash, created_at, completed_at, expires_at)
			       SELECT gen_random_uuid(), $1, $2, 'completed', 1, '\x00', t, t, t
			         FROM (SELECT $3::timestamptz + i * interval '1 second' AS t FROM generate_series(-30000, 999) i) g`,
			left: `SELECT count(*) FROM batches`,
			run: func(st *store.Store) (int64, error) {
				return st.DeleteOldBatches(context.Background(), before, 7000)
			},
		},
		{
			name: "idempotency keys", table: "batches", statement: "ExpireIdempotencyKeys",
			fill: `INSERT INTO batches (id, account_id, project_id, status, total_requests, idempotency_key, request_hash, created_at, expires_at)
			       SELECT gen_random_uuid(), $1, $2, 'queued', 1, 'key ' || i, '\x00', t, t
			         FROM (SELECT i, $3::timestamptz + i * interval '1 second' AS t FROM generate_series(-30000, 999) i) g`,
			left: `SELECT count(*) FROM batches WHERE idempotency_key IS NOT NULL`,
			run: func(st *store.Store) (int64, error) {
				return st.ExpireIdempotencyKeys(context.Background(), before, 7000)
			},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t)
			_, p := b.key(t, "acme", gateway.TierDeveloper, gateway.ScopeInference)
			_, err := b.store.Pool().Exec(b.ctx, `ALTER TABLE `+c.table+` SET (autovacuum_enabled = off)`)
			require.NoError(t, err)
			args := []any{p.AccountID, p.ProjectID, before}
			if c.table == "evidence" {
				args = args[:1]
			}
			_, err = b.store.Pool().Exec(b.ctx, c.fill, args...)
			require.NoError(t, err)
			var handled int64
			for {
				n, err := c.run(b.store)
				require.NoError(t, err)
				require.LessOrEqual(t, n, int64(7000))
				if n == 0 {
					break
				}
				handled += n
			}
			var left int64
			require.NoError(t, b.store.Pool().QueryRow(b.ctx, c.left).Scan(&left))
			require.Equal(t, int64(31_000), handled+left)
			require.GreaterOrEqual(t, handled, int64(30_000), "what was due")
			require.Less(t, handled, int64(30_010), "and only that")

			explained, plans := b.explained(t)
			_, err = explained.Pool().Exec(b.ctx, `SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on`)
			require.NoError(t, err)
			for range 2 { // from the start, then from where the first run stopped
				_, err = c.run(explained)
				require.NoError(t, err)
			}
			runs := plansOf(t, plans(), []string{"-- name: " + c.statement + " "})
			require.Len(t, runs, 2, "both runs were explained: %q", plans())
			var read []int
			for _, run := range runs {
				m := regexp.MustCompile(`Buffers: shared hit=(\d+)`).FindStringSubmatch(run) // the whole statement's, the first
				require.NotNil(t, m, run)
				n, err := strconv.Atoi(m[1])
				require.NoError(t, err)
				read = append(read, n)
			}
			require.Greater(t, read[0], 50, "a replica that starts reads from the start: %s", runs[0])
			require.Less(t, read[1], 20, "then from where it stopped: %s", runs[1])
		})
	}
}

// BenchmarkFoldOldUsage: one run of the pass over usage past the retention,
// 1,000 rows a run:
//   - requests: among accounts holding 400,000 requests of the last 100 days
//     between them, 90 % of them past the horizon; reported per request;
//   - minutes: folded sums by minute, 100,000 of them kept; reported per
//     minute removed;
//   - idle: 100,000 accounts, 20,000 of them with requests, none past the
//     horizon (what a run costs once it has caught up); reported per account
//     looked at.
func BenchmarkFoldOldUsage(b *testing.B) {
	ctx := context.Background()
	setup := func(b *testing.B) (*testBundle, *gateway.Principal) {
		bundle := &testBundle{ctx: ctx, store: store.New(testdb.New(b))}
		_, p := bundle.key(b, "acme", gateway.TierDeveloper, gateway.ScopeInference)
		return bundle, p
	}
	exec := func(b *testing.B, bundle *testBundle, sql string, args ...any) {
		_, err := bundle.store.Pool().Exec(ctx, sql, args...)
		require.NoError(b, err)
	}
	const insertRequests = `
		INSERT INTO requests (id, account_id, project_id, api_key_id, model, entry_point, status,
		                      input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
		SELECT gen_random_uuid(), $1, $2, $3, 'instant', 'responses', 'completed', 10, 20, 10, 20, 30, t, t
		  FROM (SELECT $4::timestamptz + i * ($5::interval / $6) AS t FROM generate_series(0, $6 - 1) i) g`
	run := func(b *testing.B, bundle *testBundle, horizon time.Time, want int64) {
		for b.Loop() {
			n, err := bundle.store.FoldOldUsage(ctx, horizon, 1000)
			if err != nil || n != want {
				b.Fatalf("handled %d rows, want %d: %v", n, want, err)
			}
		}
	}
	for _, accounts := range []int{1, 4} {
		b.Run(fmt.Sprintf("requests/accounts=%d", accounts), func(b *testing.B) {
			const requests = 400_000
			bundle, _ := setup(b)
			now := time.Now().UTC()
			horizon, from := now.Add(-10*24*time.Hour), now.Add(-100*24*time.Hour)
			for i := range accounts {
				_, p := bundle.key(b, fmt.Sprintf("account %d", i), gateway.TierDeveloper, gateway.ScopeInference)
				exec(b, bundle, insertRequests, p.AccountID, p.ProjectID, p.KeyID, from, now.Sub(from), requests/accounts)
			}
			for { // the sums by minute the requests' trigger wrote, folded, as they are an hour later
				n, err := bundle.store.FoldUsageMinutes(ctx, now, 100_000)
				require.NoError(b, err)
				if n == 0 {
					break
				}
			}
			exec(b, bundle, `VACUUM ANALYZE`)
			run(b, bundle, horizon, 1000)
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/1000, "µs/request")
		})
	}
	b.Run("minutes", func(b *testing.B) {
		bundle, p := setup(b)
		horizon := time.Now().UTC().Add(-90 * 24 * time.Hour).Truncate(time.Minute)
		exec(b, bundle, `
			INSERT INTO usage_minutes (account_id, minute, model, backend, requests, input_rungs, output_rungs, total_rungs)
			SELECT $1, $2::timestamptz + i * interval '1 minute', 'instant', 0, 1, 10, 20, 30
			  FROM generate_series(-1000000, 99999) i`, p.AccountID, horizon)
		exec(b, bundle, `VACUUM ANALYZE usage_minutes`)
		run(b, bundle, horizon, 1000)
		b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/1000, "µs/minute")
	})
	b.Run("idle", func(b *testing.B) {
		bundle, p := setup(b)
		exec(b, bundle, `INSERT INTO accounts (id, name, tier) SELECT gen_random_uuid(), 'account ' || i, 'developer' FROM generate_series(1, 99999) i`)
		now := time.Now().UTC()
		exec(b, bundle, `
			INSERT INTO requests (id, account_id, project_id, api_key_id, model, entry_point, status,
			                      input_tokens, output_tokens, input_rungs, output_rungs, total_rungs, created_at, completed_at)
			SELECT gen_random_uuid(), a.id, $1, $2, 'instant', 'responses', 'completed', 10, 20, 10, 20, 30, t, t
			  FROM (SELECT id FROM accounts LIMIT 20000) a, LATERAL (SELECT $3::timestamptz - i * interval '1 hour' AS t FROM generate_series(1, 5) i) g`,
			p.ProjectID, p.KeyID, now)
		exec(b, bundle, `VACUUM ANALYZE`)
		run(b, bundle, now.Add(-90*24*time.Hour), 0)
		b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/5000, "µs/account")
	})
}
