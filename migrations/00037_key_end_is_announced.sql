-- +goose Up
-- A change to a key's end (expires_at, 00036: set by a rotation) is announced
-- as a revocation is, so replicas drop the key from their caches at once
-- instead of serving it until their entry's own time runs out.
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
