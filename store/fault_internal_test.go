package store

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
)

// TestIsolated: a group operation the database is away for ends there; one
// that fails for its data runs again account by account, and only an account
// that fails alone for its data is set aside, skipped by the next runs.
func TestIsolated(t *testing.T) {
	t.Parallel()
	away := &pgconn.PgError{Code: "57P01"}
	bad := &pgconn.PgError{Code: "22003"}
	first, second, third := uuid.New(), uuid.New(), uuid.New()
	// fails is each account's outcome alone; the whole group fails with
	// group.
	run := func(group error, fails map[uuid.UUID]error) func([]uuid.UUID, *uuid.UUID) (int64, error) {
		return func(_ []uuid.UUID, account *uuid.UUID) (int64, error) {
			if account == nil {
				return 0, group
			}
			if err := fails[*account]; err != nil {
				return 0, err
			}
			return 1, nil
		}
	}
	listAll := func(skip []uuid.UUID) ([]uuid.UUID, error) {
		var out []uuid.UUID
		for _, id := range []uuid.UUID{first, second, third} {
			if !slices.Contains(skip, id) {
				out = append(out, id)
			}
		}
		return out, nil
	}

	t.Run("away", func(t *testing.T) {
		t.Parallel()
		var q quarantine
		listed := false
		_, err := q.isolated("folding", "account", run(away, nil), func([]uuid.UUID) ([]uuid.UUID, error) { listed = true; return nil, nil })
		require.ErrorIs(t, err, away)
		require.ErrorContains(t, err, "error folding: ")
		require.False(t, listed, "no account is tried alone while the database is away")
		require.Empty(t, q.members())
	})
	t.Run("data", func(t *testing.T) {
		t.Parallel()
		var q quarantine
		n, err := q.isolated("folding", "account", run(bad, map[uuid.UUID]error{first: bad, second: away}), listAll)
		require.Equal(t, int64(1), n, "the third account is folded")
		require.ErrorIs(t, err, bad)
		require.ErrorIs(t, err, away)
		require.ErrorContains(t, err, "error folding of account "+first.String()+" (set aside for 1m0s): ")
		require.ErrorContains(t, err, "error folding of account "+second.String()+": ", "the database away: not set aside, nor said to be")
		require.Equal(t, []uuid.UUID{first}, q.members(), "only the account failing for its data is set aside")

		var skipped []uuid.UUID
		_, err = q.isolated("folding", "account", func(skip []uuid.UUID, _ *uuid.UUID) (int64, error) { skipped = skip; return 0, nil }, listAll)
		require.NoError(t, err)
		require.Equal(t, []uuid.UUID{first}, skipped, "the next run leaves it out")
	})
	t.Run("list fails", func(t *testing.T) {
		t.Parallel()
		var q quarantine
		_, err := q.isolated("folding", "account", run(bad, nil), func([]uuid.UUID) ([]uuid.UUID, error) { return nil, away })
		require.ErrorIs(t, err, bad)
		require.ErrorContains(t, err, "listing accounts: "+away.Error())
	})
}

// TestQuarantineEnds: a member set aside is left out until its period
// ends, then tried again.
func TestQuarantineEnds(t *testing.T) {
	t.Parallel()
	var q quarantine
	held, ended := uuid.New(), uuid.New()
	q.add(held)
	q.add(ended)
	q.until[ended] = time.Now().Add(-time.Millisecond)
	require.Equal(t, []uuid.UUID{held}, q.members())
	require.NotContains(t, q.until, ended, "forgotten once ended")
	require.NotNil(t, (&quarantine{}).members(), "an empty list, never nil (NULL would match no row)")
}

// TestSharedSessionHint: a statement of pgx's cache found already there, or
// gone, in a new connection's session is named as a pooler's doing; other
// errors are not.
func TestSharedSessionHint(t *testing.T) {
	t.Parallel()
	for _, err := range []error{
		&pgconn.PgError{Code: "42P05", Message: `prepared statement "stmtcache_1f2e" already exists`},
		&pgconn.PgError{Code: "26000", Message: `prepared statement "stmtcache_1f2e" does not exist`},
	} {
		require.Contains(t, sharedSessionHint(err), "pools by transaction", "%v", err)
	}
	for _, err := range []error{
		&pgconn.PgError{Code: "26000", Message: `prepared statement "mine" does not exist`},
		&pgconn.PgError{Code: "42601", Message: `syntax error near "stmtcache_1f2e"`},
		errors.New(`"stmtcache_1f2e"`),
	} {
		require.Empty(t, sharedSessionHint(err), "%v", err)
	}
}
