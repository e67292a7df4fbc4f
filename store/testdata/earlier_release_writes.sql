-- What a replica of the release before migration 00011 writes, for
-- TestMigrationMovesReservations: a reservation for an item it creates, a
-- cancel through the reservations, and the job that released lapsed ones.
-- None of it may fail, and the table must stay empty.
INSERT INTO reservations (request_id, account_id, project_id, day, charged_rungs, reserved_rungs, expires_at)
SELECT '01900000-0000-7000-8000-0000000000d0', a.id, p.id, (now() AT TIME ZONE 'UTC')::date, 100, 0, now() - interval '1 day'
  FROM accounts a JOIN projects p ON p.account_id = a.id WHERE a.name = 'acme' AND p.name = 'default';
UPDATE reservations SET settled_rungs = 0 WHERE settled_rungs IS NULL;
SELECT release_expired_reservations(100);
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM reservations) THEN
        RAISE EXCEPTION 'the retired reservations table kept a row';
    END IF;
END $$;
