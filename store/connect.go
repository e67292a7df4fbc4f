package store

import (
	"context"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Connect returns a pool on url whose connections encode uuid.UUID
// directly (see RegisterUUID); maxConns, when positive, caps it.
func Connect(ctx context.Context, url string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("error parsing database URL: %w", err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	cfg.AfterConnect = func(_ context.Context, conn *pgx.Conn) error {
		RegisterUUID(conn.TypeMap())
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("error connecting to PostgreSQL: %w", err)
	}
	return pool, nil
}

// RegisterUUID teaches m to send uuid.UUID as PostgreSQL's binary uuid.
// Without it pgx reaches uuid.UUID only as a driver.Valuer: every value is
// formatted as text, refused by the binary encoder (an error built with
// fmt.Errorf), parsed back and encoded, which showed up as a tenth of the
// gateway's CPU while draining batches (eight uuids per item created). Reads
// are left to uuid.UUID's sql.Scanner, which pgx prefers to any wrapper.
func RegisterUUID(m *pgtype.Map) {
	m.TryWrapEncodePlanFuncs = append([]pgtype.TryWrapEncodePlanFunc{wrapUUIDEncode}, m.TryWrapEncodePlanFuncs...)
}

// pgUUID is uuid.UUID with the method pgx's uuid codec encodes from.
type pgUUID uuid.UUID

// UUIDValue implements pgtype.UUIDValuer.
func (u pgUUID) UUIDValue() (pgtype.UUID, error) {
	return pgtype.UUID{Bytes: u, Valid: true}, nil
}

func wrapUUIDEncode(value any) (pgtype.WrappedEncodePlanNextSetter, any, bool) {
	if u, ok := value.(uuid.UUID); ok {
		return &uuidEncodePlan{}, pgUUID(u), true
	}
	return nil, nil, false
}

type uuidEncodePlan struct{ next pgtype.EncodePlan }

func (p *uuidEncodePlan) SetNext(next pgtype.EncodePlan) { p.next = next }

func (p *uuidEncodePlan) Encode(value any, buf []byte) ([]byte, error) {
	return p.next.Encode(pgUUID(value.(uuid.UUID)), buf)
}
