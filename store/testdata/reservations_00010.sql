-- A ledger as migration 00010 left it, for TestMigrationMovesReservations:
-- account "acme" (created by the test) has one batch of three items of
-- estimate 100 on a project capped at 1,000, charged 300 to today, and a
-- reservation no item holds (charged 50).
--   item 0: running, its reservation holds 100 of the budget;
--   item 1: completed at 40, settled, not yet folded (still reserved 100);
--   item 2: queued.
DO $$
DECLARE
    v_account uuid := (SELECT id FROM accounts WHERE name = 'acme');
    v_project uuid := (SELECT id FROM projects WHERE account_id = v_account AND name = 'default');
    v_key     uuid := (SELECT k.id FROM api_keys k WHERE k.project_id = v_project LIMIT 1);
    v_batch   uuid := '01900000-0000-7000-8000-0000000000b1';
    v_day     date := (now() AT TIME ZONE 'UTC')::date;
BEGIN
    INSERT INTO daily_charges (account_id, day, charged_rungs) VALUES (v_account, v_day, 350);
    UPDATE projects SET reserved_rungs = 200 WHERE id = v_project;
    INSERT INTO batches (id, account_id, project_id, status, total_requests, request_hash, created_at, started_at, expires_at)
    VALUES (v_batch, v_account, v_project, 'in_progress', 3, '\x00', now(), now(), now() + interval '1 day');
    INSERT INTO batch_items (batch_id, idx, account_id, project_id, api_key_id, request_id, status, request, model,
                             estimate_rungs, queued_at, expires_at, lease_owner, lease_expires_at, started_at,
                             content, input_rungs, output_rungs, total_rungs, completed_at)
    VALUES
        (v_batch, 0, v_account, v_project, v_key, '01900000-0000-7000-8000-0000000000c0', 'in_progress',
         '{"prompt": "item 0", "model": "instant", "max_output_rungs": 10}', 'instant', 100, now(), now() + interval '1 day',
         '01900000-0000-7000-8000-00000000000a', now() + interval '1 hour', now(), NULL, 0, 0, 0, NULL),
        (v_batch, 1, v_account, v_project, v_key, '01900000-0000-7000-8000-0000000000c1', 'completed',
         '{"prompt": "item 1", "model": "instant", "max_output_rungs": 10}', 'instant', 100, now(), now() + interval '1 day',
         NULL, NULL, now(), 'done', 1, 39, 40, now()),
        (v_batch, 2, v_account, v_project, v_key, '01900000-0000-7000-8000-0000000000c2', 'queued',
         '{"prompt": "item 2", "model": "instant", "max_output_rungs": 10}', 'instant', 100, now(), now() + interval '1 day',
         NULL, NULL, NULL, NULL, 0, 0, 0, NULL);
    INSERT INTO reservations (request_id, account_id, project_id, day, charged_rungs, reserved_rungs, expires_at, settled_rungs)
    VALUES
        ('01900000-0000-7000-8000-0000000000c0', v_account, v_project, v_day, 100, 100, now() + interval '1 day', NULL),
        ('01900000-0000-7000-8000-0000000000c1', v_account, v_project, v_day, 100, 100, now() + interval '1 day', 40),
        ('01900000-0000-7000-8000-0000000000c2', v_account, v_project, v_day, 100, 0, now() + interval '1 day', NULL),
        ('01900000-0000-7000-8000-0000000000c9', v_account, v_project, v_day, 50, 0, now() + interval '1 day', NULL);
END $$;
