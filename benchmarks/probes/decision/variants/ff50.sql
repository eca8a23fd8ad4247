-- Not a statement change: today's statements, with the aggregate-state table at fillfactor 50
-- (a storage parameter, which would need a migration), so that more lease writes and releases
-- are HOT updates. Measured for comparison only.
-- name: setup_extra
ALTER TABLE @S@ SET (fillfactor = 50)
