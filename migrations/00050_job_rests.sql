-- +goose Up
-- A maintenance job resting through a backlog: after a run that found a full
-- batch of old rows, a cleanup job rests until `until`, on every replica
-- (each job runs under its advisory lock on one replica at a time, but
-- without this the others took it up while the replica that ran it rested,
-- and a backlog's cleanups took a tenth of the time of each replica instead
-- of a tenth in all). A row a cleanup job; the rest is written in the same
-- transaction as the job's lock is held in, so no replica takes the job up
-- between its run and its rest.
CREATE TABLE job_rests (
    job   text PRIMARY KEY,
    until timestamptz NOT NULL
);

-- +goose Down
DROP TABLE job_rests;
