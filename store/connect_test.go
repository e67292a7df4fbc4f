package store_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rungworks/gateway/internal/testdb"
	"github.com/rungworks/gateway/store"
)

func TestUUIDsRoundTrip(t *testing.T) {
	t.Parallel()
	pool := testdb.New(t) // connected by store.Connect
	ctx := context.Background()
	one, two := uuid.Must(uuid.NewV7()), uuid.New()
	var (
		gotOne  uuid.UUID
		gotMany []uuid.UUID
		gotNil  *uuid.UUID
		gotPtr  *uuid.UUID
		text    string
	)
	err := pool.QueryRow(ctx, "SELECT $1::uuid, $2::uuid[], $3::uuid, $4::uuid, $1::uuid::text",
		one, []uuid.UUID{one, two}, (*uuid.UUID)(nil), &two).Scan(&gotOne, &gotMany, &gotNil, &gotPtr, &text)
	require.NoError(t, err)
	require.Equal(t, one, gotOne)
	require.Equal(t, []uuid.UUID{one, two}, gotMany)
	require.Nil(t, gotNil)
	require.Equal(t, &two, gotPtr)
	require.Equal(t, one.String(), text, "PostgreSQL received the same uuid")

}

// TestSessionsBoundWhatALostClientHolds: each session the store opens has the
// server end it when its client is lost (a transaction idle past
// IdleTransactionTimeout, keepalives unanswered), and the database URL's own
// settings are kept. The keepalives' effect needs a network that drops
// packets, which a test here cannot make; TestATransactionTheNetworkLost-
// ReleasesItsLocks shows the idle bound's.
func TestSessionsBoundWhatALostClientHolds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	show := func(pool *pgxpool.Pool) (settings [4]string) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT current_setting('idle_in_transaction_session_timeout'),
			current_setting('tcp_keepalives_idle'), current_setting('tcp_keepalives_interval'), current_setting('tcp_keepalives_count')`).
			Scan(&settings[0], &settings[1], &settings[2], &settings[3]))
		return settings
	}
	url := testdb.URL(t)
	require.Equal(t, [4]string{"10s", "10", "5", "3"}, show(testdb.Connect(t, url)))
	require.Equal(t, [4]string{"1min", "20", "5", "3"}, show(testdb.Connect(t, url+"&idle_in_transaction_session_timeout=60000&tcp_keepalives_idle=20")))
}

// BenchmarkEncodeUUID: a uuid.UUID sent in binary, as pgx finds it on its own
// (through driver.Valuer and text) and as RegisterUUID teaches it.
func BenchmarkEncodeUUID(b *testing.B) {
	u := uuid.Must(uuid.NewV7())
	for _, registered := range []bool{false, true} {
		name := "valuer"
		if registered {
			name = "registered"
		}
		b.Run(name, func(b *testing.B) {
			m := pgtype.NewMap()
			if registered {
				store.RegisterUUID(m)
			}
			buf := make([]byte, 0, 64)
			b.ReportAllocs()
			for b.Loop() {
				out, err := m.Encode(pgtype.UUIDOID, pgx.BinaryFormatCode, u, buf[:0])
				if err != nil || len(out) != 16 {
					b.Fatalf("encoded %d bytes: %v", len(out), err)
				}
			}
		})
	}
}
