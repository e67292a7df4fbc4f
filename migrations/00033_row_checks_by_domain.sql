-- +goose Up
-- The invariants of single columns of the hot tables as domains instead of
-- table CHECK constraints. PostgreSQL reads a table's CHECK constraints from
-- their stored text, and plans them, on every execution of a statement that
-- writes the table (ExecConstraints: a tenth of a settlement's time, for the
-- eight checks of requests and the three of quota_leases, which every
-- settlement updates); a domain's constraints are read and planned once per
-- session and kept. The same rules hold for every row written: an amount of
-- tokens or rungs is never negative, a model, entry point and status are one
-- of the known. Only the check that a request's total is its input and output
-- stays a table constraint.
--
-- In an instant, with no row rewritten or read: each column changes to a
-- domain over its own type, declared without constraints, and each domain
-- then gets its constraint NOT VALID (checked for every row written from now
-- on; the rows already stored were checked by the constraints dropped). A
-- table constraint on a column whose type changes would be checked again over
-- the whole table, under an exclusive lock, so they are dropped first (the
-- total's check too, added again NOT VALID).
--
-- Its exclusive locks on requests and quota_leases wait for the statements
-- using them, and every settlement waits behind them meanwhile. Rather than
-- hold settlements up behind a long read of requests, the migration gives up
-- after five seconds without its locks (lock_timeout: the replica does not
-- start, and the next start tries again).
SET LOCAL lock_timeout = '5s';
CREATE DOMAIN non_negative AS bigint;
CREATE DOMAIN model_name AS text;
CREATE DOMAIN entry_point_name AS text;
CREATE DOMAIN request_status AS text;

ALTER TABLE requests
    DROP CONSTRAINT requests_model_check,
    DROP CONSTRAINT requests_entry_point_check,
    DROP CONSTRAINT requests_status_check,
    DROP CONSTRAINT requests_input_tokens_check,
    DROP CONSTRAINT requests_output_tokens_check,
    DROP CONSTRAINT requests_input_rungs_check,
    DROP CONSTRAINT requests_output_rungs_check,
    DROP CONSTRAINT requests_check;
ALTER TABLE requests
    ALTER COLUMN model TYPE model_name,
    ALTER COLUMN entry_point TYPE entry_point_name,
    ALTER COLUMN status TYPE request_status,
    ALTER COLUMN input_tokens TYPE non_negative,
    ALTER COLUMN output_tokens TYPE non_negative,
    ALTER COLUMN input_rungs TYPE non_negative,
    ALTER COLUMN output_rungs TYPE non_negative;

ALTER TABLE quota_leases
    DROP CONSTRAINT quota_leases_daily_rungs_check,
    DROP CONSTRAINT quota_leases_budget_rungs_check,
    DROP CONSTRAINT quota_leases_used_rungs_check;
ALTER TABLE quota_leases
    ALTER COLUMN daily_rungs TYPE non_negative,
    ALTER COLUMN budget_rungs TYPE non_negative,
    ALTER COLUMN used_rungs TYPE non_negative;

ALTER DOMAIN non_negative ADD CONSTRAINT non_negative_check CHECK (VALUE >= 0) NOT VALID;
ALTER DOMAIN model_name ADD CONSTRAINT model_name_check CHECK (VALUE IN ('instant', 'reasoning', 'elements')) NOT VALID;
ALTER DOMAIN entry_point_name ADD CONSTRAINT entry_point_name_check CHECK (VALUE IN ('responses', 'chat', 'batch')) NOT VALID;
ALTER DOMAIN request_status ADD CONSTRAINT request_status_check CHECK (VALUE IN ('completed', 'failed')) NOT VALID;
ALTER TABLE requests ADD CONSTRAINT requests_check CHECK (total_rungs = input_rungs + output_rungs) NOT VALID;

-- +goose Down
ALTER TABLE requests DROP CONSTRAINT requests_check;
ALTER TABLE quota_leases
    ALTER COLUMN daily_rungs TYPE bigint,
    ALTER COLUMN budget_rungs TYPE bigint,
    ALTER COLUMN used_rungs TYPE bigint;
ALTER TABLE requests
    ALTER COLUMN model TYPE text,
    ALTER COLUMN entry_point TYPE text,
    ALTER COLUMN status TYPE text,
    ALTER COLUMN input_tokens TYPE bigint,
    ALTER COLUMN output_tokens TYPE bigint,
    ALTER COLUMN input_rungs TYPE bigint,
    ALTER COLUMN output_rungs TYPE bigint;
ALTER TABLE quota_leases
    ADD CONSTRAINT quota_leases_daily_rungs_check CHECK (daily_rungs >= 0) NOT VALID,
    ADD CONSTRAINT quota_leases_budget_rungs_check CHECK (budget_rungs >= 0) NOT VALID,
    ADD CONSTRAINT quota_leases_used_rungs_check CHECK (used_rungs >= 0) NOT VALID;
ALTER TABLE requests
    ADD CONSTRAINT requests_model_check CHECK (model IN ('instant', 'reasoning', 'elements')) NOT VALID,
    ADD CONSTRAINT requests_entry_point_check CHECK (entry_point IN ('responses', 'chat', 'batch')) NOT VALID,
    ADD CONSTRAINT requests_status_check CHECK (status IN ('completed', 'failed')) NOT VALID,
    ADD CONSTRAINT requests_input_tokens_check CHECK (input_tokens >= 0) NOT VALID,
    ADD CONSTRAINT requests_output_tokens_check CHECK (output_tokens >= 0) NOT VALID,
    ADD CONSTRAINT requests_input_rungs_check CHECK (input_rungs >= 0) NOT VALID,
    ADD CONSTRAINT requests_output_rungs_check CHECK (output_rungs >= 0) NOT VALID,
    ADD CONSTRAINT requests_check CHECK (total_rungs = input_rungs + output_rungs) NOT VALID;
DROP DOMAIN request_status;
DROP DOMAIN entry_point_name;
DROP DOMAIN model_name;
DROP DOMAIN non_negative;
