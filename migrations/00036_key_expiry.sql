-- +goose Up
-- A key may be issued with an end: from expires_at on it is refused, as a
-- revoked key is (NULL: it never expires). A nullable column without a
-- default is added without rewriting the table.
ALTER TABLE api_keys ADD COLUMN expires_at timestamptz;

-- +goose Down
ALTER TABLE api_keys DROP COLUMN expires_at;
