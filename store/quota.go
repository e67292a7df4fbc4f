package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rungworks/gateway"
	"github.com/rungworks/gateway/apikey"
	"github.com/rungworks/gateway/gen/db"
)

// LookupKey resolves a bearer token to its principal (its Rate left unset). A
// malformed, unknown or revoked key is UNAUTHORIZED.
func (s *Store) LookupKey(ctx context.Context, token string) (*gateway.Principal, error) {
	prefix, err := apikey.Parse(token)
	if err != nil {
		return nil, gateway.UnauthorizedError()
	}
	row, err := s.queries.LookupKey(ctx, s.pool, db.LookupKeyParams{Prefix: prefix, Hash: apikey.Hash(token)})
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, gateway.UnauthorizedError()
	}
	if err != nil {
		return nil, fmt.Errorf("error looking up API key: %w", err)
	}
	scopes := make([]gateway.Scope, len(row.Scopes))
	for i, sc := range row.Scopes {
		scopes[i] = gateway.Scope(sc)
	}
	return &gateway.Principal{
		KeyID:        row.KeyID,
		ProjectID:    row.ProjectID,
		ProjectName:  row.ProjectName,
		AccountID:    row.AccountID,
		AccountName:  row.AccountName,
		Tier:         gateway.Tier(row.Tier),
		Scopes:       scopes,
		KeyExpiresAt: row.ExpiresAt,
	}, nil
}

// ListenPrincipals calls listening once it listens for changes to keys,
// accounts and projects, then changed on every change, with the table's name
// and the account the changed row belongs to (uuid.Nil when the notification
// does not name one: any account may have changed), until ctx ends, on a
// connection of its own. It returns when the connection fails or stops
// answering, for the caller to retry; changes made while it was not
// listening are not reported.
func (s *Store) ListenPrincipals(ctx context.Context, listening func(), changed func(table string, account uuid.UUID)) error {
	return s.listen(ctx, func(ctx context.Context, conn *pgxpool.Conn) error {
		return s.queries.ListenPrincipals(ctx, conn)
	}, listening, func(n *pgconn.Notification) {
		table, account, _ := strings.Cut(n.Payload, ":")
		id, _ := uuid.Parse(account) // uuid.Nil when it names none
		changed(table, id)
	})
}

// RateGrant is a slice of a key's requests for one minute.
type RateGrant struct {
	// Granted is how many requests the slice holds (0: the limit is reached).
	Granted int
	// Used is the key's sliding-window count after the grant, slices included.
	Used float64
	// Previous and Current are the counts Used weighs: the key's previous
	// minute, and its current minute after the grant.
	Previous, Current int
}

// LeaseRate grants a slice of key's requests of the minute of now: 1/share of
// what the sliding window leaves under limit, at least one while any is left.
func (s *Store) LeaseRate(ctx context.Context, keyID uuid.UUID, now time.Time, limit, share int) (RateGrant, error) {
	row, err := s.queries.LeaseRate(ctx, s.pool, db.LeaseRateParams{KeyID: keyID, Now: now, RateLimit: int32(limit), Share: int32(share)})
	if err != nil {
		return RateGrant{}, fmt.Errorf("error leasing rate: %w", err)
	}
	return RateGrant{Granted: int(row.Granted), Used: row.Used, Previous: int(row.PreviousCount), Current: int(row.CurrentCount)}, nil
}

// LeaseRateAhead grants a slice of key's requests of the minute starting at
// window before it starts, sized as LeaseRate sizes one at its start; while
// it is held, the grants of the minute before leave room for it.
func (s *Store) LeaseRateAhead(ctx context.Context, keyID uuid.UUID, window time.Time, limit, share int) (RateGrant, error) {
	row, err := s.queries.LeaseRateAhead(ctx, s.pool, db.LeaseRateAheadParams{KeyID: keyID, WindowStart: window, RateLimit: int32(limit), Share: int32(share)})
	if err != nil {
		return RateGrant{}, fmt.Errorf("error leasing rate ahead: %w", err)
	}
	return RateGrant{Granted: int(row.Granted), Used: row.Used, Previous: int(row.PreviousCount), Current: int(row.CurrentCount)}, nil
}

// RateReturn is the unused part of a key's slice of one minute.
type RateReturn struct {
	KeyID  uuid.UUID
	Window time.Time
	Count  int
}

// ReturnRate gives back unused parts of rate slices, in one statement.
func (s *Store) ReturnRate(ctx context.Context, returns []RateReturn) error {
	p := db.ReturnRateParams{}
	for _, r := range returns {
		p.KeyIds = append(p.KeyIds, r.KeyID)
		p.Windows = append(p.Windows, r.Window)
		p.Counts = append(p.Counts, int32(r.Count))
	}
	if err := s.queries.ReturnRate(ctx, s.pool, p); err != nil {
		return fmt.Errorf("error returning rate slices: %w", err)
	}
	return nil
}

// QuotaRequest asks for a slice of an account-day's ceiling and, when the
// project is capped, of its budget, added to a replica's lease.
type QuotaRequest struct {
	LeaseID   uuid.UUID
	Owner     uuid.UUID
	AccountID uuid.UUID
	ProjectID uuid.UUID
	Day       time.Time
	// DefaultCeiling applies to an account without a ceiling of its own.
	DefaultCeiling int64
	// Need is the least grant of use; less is refused.
	Need int64
	// Share sizes the slice: 1/Share of what the caps leave (at least Need).
	Share int
	// Lease is how long the lease lasts unless renewed, from the statement's
	// start by the database's clock (negative: it has run out).
	Lease time.Duration
}

// QuotaGrant is the outcome of a QuotaRequest.
type QuotaGrant struct {
	// Outcome is gateway.AdmitOK, AdmitDaily or AdmitBudget.
	Outcome string
	// Free is, on a refusal, what the limit that refused leaves once the
	// requests running end and the slices replicas hold go back: the ceiling
	// less what is charged for good, or the cap less what is spent.
	Free int64
	// Batches is, on a refusal by the ceiling, what the account's batch
	// items of the day not yet finished hold of its charge at their
	// estimates (counted in it, so not in Free).
	Batches int64
	// Granted rungs, added to the lease (the same on the day and, when Capped,
	// on the budget).
	Granted int64
	Capped  bool
	// Ceiling and Cap (when Capped) are the account's and project's limits.
	Ceiling, Cap int64
	// Left is what the ceiling (and cap) leave after the grant.
	Left int64
}

// GrantQuota adds a slice to a lease (created on first use), or refuses; a
// refusal reads what is Free in one more statement, and one by the ceiling
// what unfinished Batches hold in another.
func (s *Store) GrantQuota(ctx context.Context, r QuotaRequest) (QuotaGrant, error) {
	row, err := s.queries.GrantQuota(ctx, s.pool, db.GrantQuotaParams{
		ID: r.LeaseID, Owner: r.Owner, AccountID: r.AccountID, ProjectID: r.ProjectID, Day: gateway.UTCDay(r.Day),
		DefaultCeiling: r.DefaultCeiling, Need: r.Need, Share: int32(r.Share), Lease: interval(r.Lease),
	})
	if err != nil {
		return QuotaGrant{}, fmt.Errorf("error granting quota: %w", err)
	}
	g := QuotaGrant{Outcome: row.Outcome, Granted: row.DailyGranted, Capped: row.Capped, Ceiling: row.Ceiling, Cap: row.Cap, Left: row.DailyLeft}
	if row.Capped {
		g.Left = min(row.DailyLeft, row.BudgetLeft)
	}
	switch g.Outcome {
	case gateway.AdmitDaily:
		if g.Free, g.Batches, err = s.dailyRoom(ctx, s.pool, r.AccountID, r.DefaultCeiling, gateway.UTCDay(r.Day), nil); err != nil {
			return QuotaGrant{}, err
		}
	case gateway.AdmitBudget:
		budget, err := s.budgetState(ctx, s.pool, r.ProjectID)
		if err != nil {
			return QuotaGrant{}, err
		}
		g.Free = max(0, g.Cap-budget.Spent)
	}
	return g, nil
}

// FoldQuotaLeases folds and deletes owner's leases ids (returned by their
// replica), returning how many were folded.
func (s *Store) FoldQuotaLeases(ctx context.Context, owner uuid.UUID, ids []uuid.UUID) (int64, error) {
	n, err := s.queries.FoldQuotaLeases(ctx, s.pool, db.FoldQuotaLeasesParams{Owner: owner, Ids: ids, Skip: []uuid.UUID{}})
	if err != nil {
		return 0, fmt.Errorf("error folding quota leases: %w", err)
	}
	return n, nil
}

// FoldExpiredQuotaLeases folds up to maxRows leases, of any replica, whose
// time ran out (their replica died or lost the database), returning how many.
// One lease that cannot be folded stops no other (D11): after a failure for
// the data, leases are folded one by one, and one failing alone is set aside
// for quarantinePeriod (named in the error).
func (s *Store) FoldExpiredQuotaLeases(ctx context.Context, maxRows int) (int64, error) {
	owners := map[uuid.UUID]uuid.UUID{} // of the leases listed, to fold each alone
	return s.foldQuarantine.isolated("folding expired quota leases", "lease", func(skip []uuid.UUID, lease *uuid.UUID) (int64, error) {
		p := db.FoldQuotaLeasesParams{Expired: int32(maxRows), Skip: skip}
		if lease != nil {
			p = db.FoldQuotaLeasesParams{Owner: owners[*lease], Ids: []uuid.UUID{*lease}, Skip: skip}
		}
		return s.queries.FoldQuotaLeases(ctx, s.pool, p)
	}, func(skip []uuid.UUID) ([]uuid.UUID, error) {
		expired, err := s.queries.ExpiredQuotaLeases(ctx, s.pool, db.ExpiredQuotaLeasesParams{Skip: skip, MaxRows: int32(maxRows)})
		ids := make([]uuid.UUID, len(expired))
		for i, l := range expired {
			owners[l.ID], ids[i] = l.Owner, l.ID
		}
		return ids, err
	})
}

// RenewQuotaLeases extends owner's leases ids to lease from now (by the
// database's clock), returning those it still holds.
func (s *Store) RenewQuotaLeases(ctx context.Context, owner uuid.UUID, ids []uuid.UUID, lease time.Duration) ([]uuid.UUID, error) {
	held, err := s.queries.RenewQuotaLeases(ctx, s.pool, db.RenewQuotaLeasesParams{Owner: owner, Ids: ids, Lease: interval(lease)})
	if err != nil {
		return nil, fmt.Errorf("error renewing quota leases: %w", err)
	}
	return held, nil
}

// Settlement is a finished request to commit, with the lease it was admitted
// under (nil: none).
type Settlement struct {
	Record  gateway.UsageRecord
	LeaseID *uuid.UUID
}

// SettleRequests commits a group of finished requests durably in one
// transaction and one round trip: their usage and evidence, and their actual
// cost on their leases. A request already stored is skipped, so a group whose
// reply was lost may be sent again. The group commits whole or not at all. A
// group that charges two leases or more locks them first, in key order, in
// the same transaction and round trip (see LockQuotaLeases in
// queries/metering.sql).
func (s *Store) SettleRequests(ctx context.Context, group []Settlement) error {
	n := len(group)
	p := db.SettleRequestsParams{
		Ids: make([]uuid.UUID, n), AccountIds: make([]uuid.UUID, n), ProjectIds: make([]uuid.UUID, n),
		ApiKeyIds: make([]uuid.UUID, n), Models: make([]string, n), EntryPoints: make([]string, n),
		Statuses: make([]string, n), InputTokens: make([]int64, n), OutputTokens: make([]int64, n),
		InputRungs: make([]int64, n), OutputRungs: make([]int64, n), TotalRungs: make([]int64, n),
		CreatedAts: make([]time.Time, n), CompletedAts: make([]time.Time, n), Sources: make([][]byte, n),
		Verdicts: make([]string, n), EvidenceExpiresAts: make([]time.Time, n), LeaseIds: make([]uuid.UUID, n),
	}
	for i, st := range group {
		r := st.Record
		p.Ids[i], p.AccountIds[i], p.ProjectIds[i], p.ApiKeyIds[i] = r.RequestID, r.Principal.AccountID, r.Principal.ProjectID, r.Principal.KeyID
		p.Models[i], p.EntryPoints[i], p.Statuses[i] = string(r.Model), string(r.Entry), "completed"
		if r.Failed {
			p.Statuses[i] = "failed"
		}
		p.InputTokens[i], p.OutputTokens[i] = r.Usage.InputTokens, r.Usage.OutputTokens
		p.InputRungs[i], p.OutputRungs[i], p.TotalRungs[i] = r.Usage.InputRungs, r.Usage.OutputRungs, r.Usage.TotalRungs
		p.CreatedAts[i], p.CompletedAts[i], p.EvidenceExpiresAts[i] = r.CreatedAt, r.CompletedAt, r.EvidenceExpiresAt
		sources, err := sourcesJSON(r.Sources)
		if err != nil {
			return err
		}
		p.Sources[i] = sources
		p.Verdicts[i] = r.Verdict // empty: none
		if st.LeaseID != nil {
			p.LeaseIds[i] = *st.LeaseID // nil: none
		}
	}
	if !severalLeases(p.LeaseIds) {
		if err := s.queries.SettleRequests(ctx, s.pool, p); err != nil {
			return fmt.Errorf("error settling requests: %w", err)
		}
		return nil
	}
	// The lock sorts the leases and reads each once; uuid.Nil names none.
	b := &pgx.Batch{}
	_ = s.queries.LockQuotaLeases(ctx, queued{Batch: b}, p.LeaseIds)
	_ = s.queries.SettleRequests(ctx, queued{Batch: b}, p)
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("error settling requests: %w", err)
	}
	return nil
}

// severalLeases reports whether ids (uuid.Nil: none) name two leases or more.
func severalLeases(ids []uuid.UUID) bool {
	first := uuid.Nil
	for _, id := range ids {
		if id == uuid.Nil || id == first {
			continue
		}
		if first != uuid.Nil {
			return true
		}
		first = id
	}
	return false
}

// queued is a db.DBTX that queues the statements of :exec queries into a
// batch, which pgx sends in one round trip and PostgreSQL runs in one
// transaction (its statements end at one Sync). Only Exec is implemented.
type queued struct {
	db.DBTX
	*pgx.Batch
}

// Exec queues sql with args.
func (q queued) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	q.Queue(sql, args...)
	return pgconn.CommandTag{}, nil
}

// sourcesJSON is a request's or an item's sources as an element of a jsonb
// array parameter: nil (NULL) when there are none.
func sourcesJSON(sources []gateway.Source) ([]byte, error) {
	if len(sources) == 0 {
		return nil, nil
	}
	raw, err := json.Marshal(sources)
	if err != nil {
		return nil, fmt.Errorf("error encoding sources: %w", err)
	}
	return raw, nil
}
