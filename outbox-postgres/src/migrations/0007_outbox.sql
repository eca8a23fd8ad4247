-- outbox-postgres migration 7: append from SQL, for services not written in Rust.
--
-- `"__SCHEMA__"."__TABLE___append"(...)` appends one event to this outbox inside the caller's
-- transaction, exactly as `PostgresOutboxStore::append` does with the default
-- `EnvelopeLimits`: it accepts and rejects the same envelopes (SQLSTATE 22023 with the Rust
-- error's text, nothing written), writes the same row, and takes part in the relay's wake-up
-- the same way (a NOTIFY on the default channel `<schema>_<table>` only while an idle relay
-- holds the wake-up gate; the shared gate lock it takes otherwise is released at the end of
-- the caller's transaction). It returns the event id.
--
-- What it does not do: the in-process backpressure hook (`AppendGuard`) of a Rust service
-- is not consulted; limits other than the defaults and a custom notify channel are not known
-- to it. See outbox-postgres/docs/sql-append.md.
CREATE OR REPLACE FUNCTION "__SCHEMA__"."__TABLE___append"(
    aggregate_type    text,
    aggregate_id      text,
    aggregate_version bigint,
    event_type        text,
    payload           bytea,
    content_type      text        DEFAULT 'application/json',
    headers           jsonb       DEFAULT '{}'::jsonb,
    schema_version    integer     DEFAULT 1,
    event_id          uuid        DEFAULT gen_random_uuid(),
    created_at        timestamptz DEFAULT now()
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $append$
#variable_conflict use_variable
DECLARE
    -- EnvelopeLimits::default(): names (and aggregate names, the smaller of max_name_len and
    -- max_aggregate_name_bytes) 255 bytes, payload 900 KiB, 32 headers of 16 KiB in all.
    max_name    constant integer := 255;
    max_payload constant integer := 921600;
    max_headers constant integer := 32;
    max_hbytes  constant integer := 16384;
    -- Rust's char::is_control (Unicode Cc) and char::is_whitespace (White_Space).
    -- Everything is validated in the C collation, whatever the caller's: a nondeterministic
    -- one (a case-insensitive column passed as an argument) refuses regular expressions, a
    -- Turkish one lowers 'I' to 'ı'.
    control     constant text COLLATE "C" := '[\u0001-\u001f\u007f-\u009f]';
    blank       constant text COLLATE "C" :=
        '^[\u0009-\u000d\u0020\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]*$';
    field   text;
    val     text COLLATE "C";
    ctype   text COLLATE "C" := content_type;
    n       integer;
    yr      integer;
    hkey    text COLLATE "C";
    hval    jsonb;
    hbytes  integer := 0;
    parts   text[] COLLATE "C";
BEGIN
    IF aggregate_type IS NULL OR aggregate_id IS NULL OR aggregate_version IS NULL
       OR event_type IS NULL OR payload IS NULL OR content_type IS NULL OR headers IS NULL
       OR schema_version IS NULL OR event_id IS NULL OR created_at IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = '22004',
            MESSAGE = 'no argument of __TABLE___append may be NULL (defaults apply when an '
                      'argument is left out)';
    END IF;
    FOREACH field IN ARRAY ARRAY['aggregate_type', 'aggregate_id', 'event_type'] LOOP
        val := CASE field WHEN 'aggregate_type' THEN aggregate_type
                          WHEN 'aggregate_id' THEN aggregate_id
                          ELSE event_type END;
        IF val ~ blank THEN
            RAISE EXCEPTION USING ERRCODE = '22023', MESSAGE = field || ' must not be empty';
        END IF;
        n := octet_length(val);
        IF n > max_name THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('%s is %s bytes long; the limit is %s', field, n, max_name);
        END IF;
        IF val ~ control THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = field || ' must not contain control characters';
        END IF;
    END LOOP;
    IF aggregate_version < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('aggregate_version must be at least 1, got %s', aggregate_version);
    END IF;
    IF schema_version < 1 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('schema_version must be at least 1, got %s', schema_version);
    END IF;
    IF ctype ~ blank OR octet_length(ctype) > max_name OR ctype ~ control THEN
        -- Quoted as Rust's `{:?}` quotes it, as far as these rules can meet: `\"`, `\\`, `\t`,
        -- `\r`, `\n`, and other control characters and white space but ' ' as `\u{hex}` (JSON
        -- would leave DEL, U+0085 and the Unicode spaces raw). Rust also escapes format
        -- characters, combining marks and unassigned code points; those stay raw here.
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'invalid payload content type ' || '"' || coalesce((SELECT string_agg(CASE
                WHEN c = '"' THEN '\"' WHEN c = '\' THEN '\\'
                WHEN c = E'\t' THEN '\t' WHEN c = E'\r' THEN '\r' WHEN c = E'\n' THEN '\n'
                WHEN c ~ control OR (c <> ' ' AND c ~ blank)
                    THEN '\u{' || to_hex(ascii(c)) || '}'
                ELSE c END, '' ORDER BY i)
            FROM unnest(regexp_split_to_array(ctype, '')) WITH ORDINALITY AS q(c, i) WHERE c <> ''), '')
            || '"';
    END IF;
    -- 'infinity' has no year (and no Rust envelope holds it): refused like any other year
    -- the wire format cannot carry, not by the integer cast below (SQLSTATE 22003).
    IF NOT isfinite(created_at) THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('created_at in year %s is outside 0..=9999, which the wire format '
                             '(RFC 3339) cannot carry', created_at);
    END IF;
    -- The year in UTC as chrono counts it (1 BC is year 0; PostgreSQL has no year 0).
    yr := extract(year FROM created_at AT TIME ZONE 'UTC')::integer;
    IF yr < 0 THEN
        yr := yr + 1;
    END IF;
    IF yr < 0 OR yr > 9999 THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('created_at in year %s is outside 0..=9999, which the wire format '
                             '(RFC 3339) cannot carry', yr);
    END IF;
    IF octet_length(payload) > max_payload THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('payload is %s bytes; the limit is %s', octet_length(payload),
                             max_payload);
    END IF;
    IF jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = 'headers must be a JSON object of string values, got a JSON '
                      || jsonb_typeof(headers);
    END IF;
    SELECT count(*) INTO n FROM jsonb_object_keys(headers);
    IF n > max_headers THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('%s headers; the limit is %s', n, max_headers);
    END IF;
    -- In the order Rust checks them (a BTreeMap: by the names' bytes), so that the first
    -- fault found is the one Rust reports.
    FOR hkey, hval IN SELECT key, value FROM jsonb_each(headers) ORDER BY key COLLATE "C" LOOP
        IF jsonb_typeof(hval) <> 'string' THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('invalid header %s: header values must be JSON strings',
                                 to_json(hkey));
        END IF;
        val := hval #>> '{}';
        IF octet_length(hkey) = 0 OR octet_length(hkey) > max_name
           OR hkey !~ '^[\u0021-\u007e]+$' THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                -- Quoted as the content type is, above.
                MESSAGE = 'invalid header ' || '"' || coalesce((SELECT string_agg(CASE
                WHEN c = '"' THEN '\"' WHEN c = '\' THEN '\\'
                WHEN c = E'\t' THEN '\t' WHEN c = E'\r' THEN '\r' WHEN c = E'\n' THEN '\n'
                WHEN c ~ control OR (c <> ' ' AND c ~ blank)
                    THEN '\u{' || to_hex(ascii(c)) || '}'
                ELSE c END, '' ORDER BY i)
            FROM unnest(regexp_split_to_array(hkey, '')) WITH ORDINALITY AS q(c, i) WHERE c <> ''), '')
            || '"'
                          || ': header names are 1..=max_name_len visible ASCII characters';
        END IF;
        -- lower() in the C collation: with the caller's collation (an argument's COLLATE, or a
        -- database whose default is Turkish) 'EVENT_ID' would lower to 'event_ıd' and pass.
        IF lower(hkey COLLATE "C") IN ('event_id', 'event_type', 'aggregate_type', 'aggregate_id',
                           'aggregate_version', 'schema_version', 'content_type',
                           'created_at') THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('invalid header %s: the name is reserved for envelope fields',
                                 to_json(hkey));
        END IF;
        IF val ~ control THEN
            RAISE EXCEPTION USING ERRCODE = '22023',
                MESSAGE = format('invalid header %s: header values must not contain control '
                                 'characters', to_json(hkey));
        END IF;
        IF lower(hkey COLLATE "C") = 'traceparent' THEN
            -- W3C: version-traceid-parentid-flags, lowercase hex, ids not all zero; version
            -- ff is invalid, version 00 has exactly four parts.
            parts := string_to_array(val, '-');
            IF coalesce(array_length(parts, 1), 0) < 4
               OR parts[1] !~ '^[0-9a-f]{2}$' OR parts[1] = 'ff'
               OR parts[2] !~ '^[0-9a-f]{32}$' OR parts[2] ~ '^0*$'
               OR parts[3] !~ '^[0-9a-f]{16}$' OR parts[3] ~ '^0*$'
               OR parts[4] !~ '^[0-9a-f]{2}$'
               OR (parts[1] = '00' AND array_length(parts, 1) <> 4) THEN
                RAISE EXCEPTION USING ERRCODE = '22023',
                    MESSAGE = format('invalid header %s: not a W3C traceparent '
                                     '(version-traceid-parentid-flags)', to_json(hkey));
            END IF;
        END IF;
        hbytes := hbytes + octet_length(hkey) + octet_length(val);
    END LOOP;
    IF hbytes > max_hbytes THEN
        RAISE EXCEPTION USING ERRCODE = '22023',
            MESSAGE = format('headers take %s bytes; the limit is %s', hbytes, max_hbytes);
    END IF;

    INSERT INTO "__SCHEMA__"."__TABLE__"
        (event_id, aggregate_type, aggregate_id, aggregate_version, event_type, schema_version,
         content_type, payload, headers, created_at, inserted_at)
    VALUES (event_id, aggregate_type, aggregate_id, aggregate_version, event_type,
            schema_version, content_type, payload, headers, created_at, clock_timestamp());

    -- The wake-up, as the Rust append does it: notify only while an idle relay holds the
    -- gate exclusively; otherwise hold the gate's shared lock to the end of this transaction,
    -- so a relay arming the gate waits for this append to end and then claims it.
    IF __CHANNEL__::text IS NOT NULL
       AND NOT pg_try_advisory_xact_lock_shared(__GATE_K1__, __GATE_K2__) THEN
        PERFORM pg_notify(__CHANNEL__::text, '');
    END IF;
    RETURN event_id;
END
$append$;

COMMENT ON FUNCTION "__SCHEMA__"."__TABLE___append"(text, text, bigint, text, bytea, text,
    jsonb, integer, uuid, timestamptz) IS
    'Appends one event to "__SCHEMA__"."__TABLE__" in the caller''s transaction, validated as '
    'the Rust envelope is (default limits); returns its event id. See '
    'outbox-postgres/docs/sql-append.md.';
