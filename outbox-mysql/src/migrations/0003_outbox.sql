-- outbox-mysql migration 3: the lease of lease mode moves from the aggregate's state row to the
-- claimed event row and a per-batch row (docs/claims.md, "MariaDB and MySQL").
--
-- * `claim_token`: the token of the lease claim that holds the row (16 zero bytes: none). Fixed
--   width and NOT NULL, so writing it changes no record's size: it rides the claim's
--   `next_attempt_at` update in place, and the completion's marking checks it in its `WHERE`
--   (fencing). No index: every claim writes it, and only rare paths (a release by owner, a
--   completion from another process) search by it. The lease ends where it always did, at
--   the row's `next_attempt_at`. An instant ADD COLUMN (MariaDB 10.3+, MySQL 8.0.12+): no
--   row is rewritten, each gets the default until its next update.
-- * `<table>_lease`: one row per claim batch, the relay that holds it (`owner`) and when the
--   lease ends (`until`), for `release_claims_of` and the reports; deleted by the batch's
--   completion or release, and by cleanup once expired.
--
-- The state table's `lease_*` columns are no longer written by this version; they are read
-- only to fence a relay of the previous version during a rolling upgrade (README, "Upgrading").
-- Each statement can run again after a failure (the runner skips a duplicate column).
ALTER TABLE __Q__`__TABLE__`
    ADD COLUMN claim_token BINARY(16) NOT NULL DEFAULT X'00000000000000000000000000000000';
CREATE TABLE IF NOT EXISTS __Q__`__TABLE___lease` (
    token       BINARY(16)   NOT NULL,
    owner       TEXT         NOT NULL,
    until       DATETIME(6)  NOT NULL,
    PRIMARY KEY (token),
    KEY until_idx (until)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
