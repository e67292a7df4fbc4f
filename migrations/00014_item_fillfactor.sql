-- +goose Up
-- A batch item's row is updated twice after it is inserted (claimed, then
-- completed with its output). Items are inserted by COPY into full pages, so
-- most of those updates found no room on their page: the new version went to
-- another page, and PostgreSQL wrote a lock record on the old version first,
-- dirtying two pages instead of one. Leaving room on each page keeps the
-- updates of an item on its page.
ALTER TABLE batch_items SET (fillfactor = 50);

-- +goose Down
ALTER TABLE batch_items RESET (fillfactor);
