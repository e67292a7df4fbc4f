-- +goose Up
-- A key may be issued with an end: from expires_at on it is refused, as a
-- revoked key is (NULL: it never expires). A nullable column without a
-- default is added without rewriting the table.
ALTER TABLE api_keys ADD COLUMN expires_at timestamptz;
-- A change to a key's end (a rotation sets it) is announced as a revocation
-- is, so replicas drop the key from their caches at once instead of serving
-- it until their entry's own time runs out.
DROP TRIGGER api_keys_changed ON api_keys;
CREATE TRIGGER api_keys_changed AFTER UPDATE ON api_keys FOR EACH ROW
    WHEN (OLD.revoked_at IS DISTINCT FROM NEW.revoked_at OR OLD.scopes IS DISTINCT FROM NEW.scopes
          OR OLD.expires_at IS DISTINCT FROM NEW.expires_at)
    EXECUTE FUNCTION notify_principals_changed();

-- +goose Down
DROP TRIGGER api_keys_changed ON api_keys;
CREATE TRIGGER api_keys_changed AFTER UPDATE ON api_keys FOR EACH ROW
    WHEN (OLD.revoked_at IS DISTINCT FROM NEW.revoked_at OR OLD.scopes IS DISTINCT FROM NEW.scopes)
    EXECUTE FUNCTION notify_principals_changed();
ALTER TABLE api_keys DROP COLUMN expires_at;
