package store_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
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
