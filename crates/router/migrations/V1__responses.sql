-- Stored responses (`/v1/responses` with `store: true`), shared by every router replica.
-- A row is found only by its tenant and id together: another tenant's id is unknown.
CREATE TABLE bellows_responses (
    tenant     TEXT        NOT NULL,
    id         TEXT        NOT NULL,
    -- The stored response as JSON text: the router reads and writes it whole, so the database
    -- need not parse it.
    stored     TEXT        NOT NULL,
    bytes      BIGINT      NOT NULL,
    created_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (tenant, id)
);
-- The sweep drops expired rows, then the oldest past the size bound.
CREATE INDEX bellows_responses_expires_at ON bellows_responses (expires_at);
CREATE INDEX bellows_responses_created_at ON bellows_responses (created_at);
