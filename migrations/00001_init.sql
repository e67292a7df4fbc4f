-- +goose Up
CREATE TABLE accounts (
    id                 uuid PRIMARY KEY,
    name               text NOT NULL UNIQUE,
    tier               text NOT NULL CHECK (tier IN ('free', 'developer')),
    -- NULL means the tier's default daily rung ceiling.
    daily_rung_ceiling bigint CHECK (daily_rung_ceiling >= 0),
    created_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE projects (
    id               uuid PRIMARY KEY,
    account_id       uuid NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    name             text NOT NULL,
    -- NULL means no cap.
    budget_cap_rungs bigint CHECK (budget_cap_rungs >= 0),
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (account_id, name)
);

CREATE TABLE api_keys (
    id         uuid PRIMARY KEY,
    project_id uuid NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    -- The public lookup part of the key (for example igw_AbCdEfGh); unique.
    prefix     text NOT NULL UNIQUE,
    -- SHA-256 of the whole key; the key itself is never stored.
    hash       bytea NOT NULL,
    scopes     text[] NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
CREATE INDEX api_keys_project_idx ON api_keys (project_id);

-- One row per request or batch item whose usage was committed.
CREATE TABLE requests (
    id            uuid PRIMARY KEY,
    account_id    uuid NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    project_id    uuid NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
    api_key_id    uuid REFERENCES api_keys (id) ON DELETE SET NULL,
    model         text NOT NULL CHECK (model IN ('instant', 'reasoning', 'elements')),
    entry_point   text NOT NULL CHECK (entry_point IN ('responses', 'chat', 'batch')),
    status        text NOT NULL CHECK (status IN ('completed', 'failed')),
    input_tokens  bigint NOT NULL CHECK (input_tokens >= 0),
    output_tokens bigint NOT NULL CHECK (output_tokens >= 0),
    input_rungs   bigint NOT NULL CHECK (input_rungs >= 0),
    output_rungs  bigint NOT NULL CHECK (output_rungs >= 0),
    total_rungs   bigint NOT NULL CHECK (total_rungs = input_rungs + output_rungs),
    created_at    timestamptz NOT NULL,
    completed_at  timestamptz NOT NULL
);
-- The usage view reads an account's requests by completion time.
CREATE INDEX requests_account_completed_idx ON requests (account_id, completed_at);
CREATE INDEX requests_project_idx ON requests (project_id);

-- Evidence behind a request, held until expires_at.
CREATE TABLE evidence (
    request_id uuid PRIMARY KEY REFERENCES requests (id) ON DELETE CASCADE,
    account_id uuid NOT NULL REFERENCES accounts (id) ON DELETE CASCADE,
    sources    jsonb NOT NULL,
    verdict    text,
    expires_at timestamptz NOT NULL
);
CREATE INDEX evidence_expires_idx ON evidence (expires_at);

-- +goose Down
DROP TABLE evidence;
DROP TABLE requests;
DROP TABLE api_keys;
DROP TABLE projects;
DROP TABLE accounts;
