# Sourced by scripts/test and scripts/demo-real: start PostgreSQL, MySQL/MariaDB, a
# Kafka-protocol broker, NATS with JetStream and RabbitMQ, and install PgBouncer (tests start
# their own, in front of PostgreSQL).
TANSU_VERSION=0.6.0
OUTBOX_STATE_DIR="${OUTBOX_STATE_DIR:-$PWD/target/services}"
mkdir -p "$OUTBOX_STATE_DIR"

log() { echo "==> $*" >&2; }

ensure_postgres() {
    if [[ -n "${DATABASE_URL:-}" ]]; then
        log "using PostgreSQL at \$DATABASE_URL"
        return
    fi
    export DATABASE_URL="postgres://postgres@127.0.0.1:5432/postgres"
    if pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then
        return
    fi
    if command -v pg_ctlcluster >/dev/null && [[ -d /etc/postgresql ]]; then
        log "starting the local PostgreSQL cluster"
        pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
        for _ in $(seq 1 50); do pg_isready -h 127.0.0.1 -p 5432 -q && return; sleep 0.2; done
    fi
    echo "error: no PostgreSQL reachable. Set DATABASE_URL to a server where the user may" >&2
    echo "       create databases (tests create one database per test), or install PostgreSQL." >&2
    exit 1
}

# MySQL or MariaDB for outbox-mysql: $MYSQL_URL when set (nothing is started then); otherwise
# the local server on 127.0.0.1:3306 (root, empty password, database `test`), started when it
# is installed but stopped. Fails with what to do when nothing answers.
mysql_answers() {
    if command -v mariadb-admin >/dev/null; then
        mariadb-admin --protocol=tcp -h 127.0.0.1 -P 3306 -u root ping >/dev/null 2>&1
    elif command -v mysqladmin >/dev/null; then
        mysqladmin --protocol=tcp -h 127.0.0.1 -P 3306 -u root ping >/dev/null 2>&1
    else
        (exec 3<>/dev/tcp/127.0.0.1/3306) 2>/dev/null
    fi
}

ensure_mysql() {
    if [[ -n "${MYSQL_URL:-}" ]]; then
        export MYSQL_URL
        log "using MySQL/MariaDB at \$MYSQL_URL"
        return
    fi
    export MYSQL_URL="mysql://root@127.0.0.1:3306/test"
    if mysql_answers; then
        return
    fi
    if [[ -x /usr/sbin/mariadbd ]]; then
        log "starting the local MariaDB server"
        start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
        for _ in $(seq 1 100); do mysql_answers && return; sleep 0.2; done
    fi
    echo "error: no MySQL or MariaDB reachable on 127.0.0.1:3306. Set MYSQL_URL to a MySQL 8.0.13+" >&2
    echo "       or MariaDB 10.6+ server where the user may create databases (tests create one" >&2
    echo "       database per test), or install MariaDB (apt-get install mariadb-server)." >&2
    exit 1
}

tansu_bin() {
    if [[ -n "${TANSU_BIN:-}" && -x "$TANSU_BIN" ]]; then echo "$TANSU_BIN"; return; fi
    if command -v tansu >/dev/null; then command -v tansu; return; fi
    if [[ -x "$HOME/.cargo/bin/tansu" ]]; then echo "$HOME/.cargo/bin/tansu"; return; fi
    log "installing tansu $TANSU_VERSION (a Kafka-compatible broker; about 11 minutes once)"
    cargo install tansu --version "$TANSU_VERSION" --locked --features dynostore,postgres >&2
    echo "$HOME/.cargo/bin/tansu"
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

wait_port() {
    local port=$1
    for _ in $(seq 1 100); do
        if (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null; then return 0; fi
        sleep 0.1
    done
    return 1
}

TANSU_PID=""
ensure_kafka() {
    if [[ -n "${KAFKA_BROKERS:-}" ]]; then
        log "using Kafka at \$KAFKA_BROKERS"
        export TANSU_BIN="${TANSU_BIN:-$(command -v tansu || true)}"
        return
    fi
    export TANSU_BIN
    TANSU_BIN="$(tansu_bin)"
    local port
    port="$(free_port)"
    log "starting tansu on 127.0.0.1:$port (memory storage)"
    "$TANSU_BIN" broker \
        --listener-url "tcp://127.0.0.1:$port" \
        --advertised-listener-url "tcp://127.0.0.1:$port" \
        --storage-engine "memory://tansu/" \
        >"$OUTBOX_STATE_DIR/tansu-$port.log" 2>&1 &
    TANSU_PID=$!
    if ! wait_port "$port"; then
        echo "error: tansu did not open port $port; log: $OUTBOX_STATE_DIR/tansu-$port.log" >&2
        exit 1
    fi
    export KAFKA_BROKERS="127.0.0.1:$port"
}

ensure_pgbouncer() {
    if [[ -n "${PGBOUNCER_BIN:-}" && -x "$PGBOUNCER_BIN" ]]; then return; fi
    local bin
    bin="$(command -v pgbouncer || true)"
    if [[ -z "$bin" && -x /usr/sbin/pgbouncer ]]; then bin=/usr/sbin/pgbouncer; fi
    if [[ -z "$bin" ]]; then
        if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
            log "installing PgBouncer (Debian package; tests start their own instances)"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >&2 \
                || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >&2; }
            bin=/usr/sbin/pgbouncer
        else
            echo "error: PgBouncer is not installed (the wake-up gate's pooler tests start it)." >&2
            echo "       Install it (apt-get install pgbouncer) or set PGBOUNCER_BIN." >&2
            exit 1
        fi
    fi
    export PGBOUNCER_BIN="$bin"
}

# Headless Chromium and its WebDriver (Debian's `chromium` and `chromium-driver`), for the web
# console's browser test (outbox-cli/tests/console_browser.rs): installed when missing; the test
# starts its own chromedriver on a free port. Exports CHROMEDRIVER and CHROMIUM_BIN.
ensure_chromium() {
    local driver browser
    driver="${CHROMEDRIVER:-$(command -v chromedriver || true)}"
    browser="${CHROMIUM_BIN:-$(command -v chromium || true)}"
    if [[ -z "$driver" || -z "$browser" ]]; then
        if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
            log "installing Chromium and chromedriver (Debian packages; the console's browser test)"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >&2 \
                || { apt-get update -q >&2 \
                     && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >&2; } \
                || true
            driver="$(command -v chromedriver || true)"
            browser="$(command -v chromium || true)"
        fi
        if [[ -z "$driver" || -z "$browser" ]]; then
            echo "error: headless Chromium and chromedriver are not installed (the web console's" >&2
            echo "       browser test drives them). Install them as root:" >&2
            echo "       apt-get install -y chromium chromium-driver" >&2
            echo "       or set CHROMEDRIVER and CHROMIUM_BIN to existing binaries." >&2
            exit 1
        fi
    fi
    export CHROMEDRIVER="$driver" CHROMIUM_BIN="$browser"
}

# host and port of a URL (scheme://[user[:password]@]host[:port][/...]); $2 is the default port.
url_host_port() {
    local rest=${1#*://}
    rest=${rest%%/*}
    rest=${rest##*@}
    local host=${rest%%:*} port=$2
    [[ "$rest" == *:* ]] && port=${rest##*:}
    [[ -z "$host" || "$host" == localhost ]] && host=127.0.0.1
    echo "$host $port"
}

answers() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# NATS with JetStream: $NATS_URL when set (it must answer), else the local server on
# 127.0.0.1:4222, started with JetStream if it is installed and stopped.
ensure_nats() {
    local hp
    if [[ -n "${NATS_URL:-}" ]]; then
        read -r -a hp <<<"$(url_host_port "$NATS_URL" 4222)"
        answers "${hp[0]}" "${hp[1]}" && { log "using NATS at \$NATS_URL"; return; }
        echo "error: nothing answers at \$NATS_URL (${hp[0]}:${hp[1]}); start NATS with JetStream (-js) there or unset NATS_URL" >&2
        exit 1
    fi
    export NATS_URL="nats://127.0.0.1:4222"
    answers 127.0.0.1 4222 && return
    local bin
    bin="$(command -v nats-server || echo /usr/sbin/nats-server)"
    if [[ -x "$bin" ]]; then
        log "starting nats-server with JetStream on 127.0.0.1:4222"
        mkdir -p "$OUTBOX_STATE_DIR/nats"
        start-stop-daemon --start --oknodo --background --exec "$bin" -- \
            -a 127.0.0.1 -p 4222 -js -sd "$OUTBOX_STATE_DIR/nats" -l "$OUTBOX_STATE_DIR/nats.log"
        for _ in $(seq 1 50); do answers 127.0.0.1 4222 && return; sleep 0.2; done
    fi
    echo "error: no NATS server answers on 127.0.0.1:4222. Install nats-server (apt-get install" >&2
    echo "       nats-server) or set NATS_URL to a server with JetStream enabled." >&2
    exit 1
}

# RabbitMQ: $AMQP_URL when set (it must answer), else the local broker on 127.0.0.1:5672
# (guest/guest), started if it is installed and stopped.
ensure_rabbitmq() {
    local hp
    if [[ -n "${AMQP_URL:-}" ]]; then
        read -r -a hp <<<"$(url_host_port "$AMQP_URL" 5672)"
        answers "${hp[0]}" "${hp[1]}" && { log "using RabbitMQ at \$AMQP_URL"; return; }
        echo "error: nothing answers at \$AMQP_URL (${hp[0]}:${hp[1]}); start RabbitMQ there or unset AMQP_URL" >&2
        exit 1
    fi
    export AMQP_URL="amqp://guest:guest@127.0.0.1:5672/%2f"
    answers 127.0.0.1 5672 && return
    if command -v rabbitmq-server >/dev/null; then
        log "starting RabbitMQ on 127.0.0.1:5672"
        rabbitmq-server -detached
        for _ in $(seq 1 150); do answers 127.0.0.1 5672 && return; sleep 0.2; done
    fi
    echo "error: no RabbitMQ answers on 127.0.0.1:5672. Install rabbitmq-server (apt-get install" >&2
    echo "       rabbitmq-server) or set AMQP_URL (e.g. amqp://user:pass@host:5672/%2f)." >&2
    exit 1
}

# Clients the SQL-append tests drive (outbox-postgres/tests/sql_append.rs): psql, and python3
# with psycopg 3 for the README's Python example (installed with pip once when missing).
ensure_sql_clients() {
    if ! command -v psql >/dev/null; then
        echo "error: psql is not installed (apt-get install postgresql-client)." >&2
        exit 1
    fi
    if ! command -v python3 >/dev/null; then
        echo "error: python3 is not installed (the README's Python example is tested)." >&2
        exit 1
    fi
    if ! python3 -c 'import psycopg' 2>/dev/null; then
        log "installing psycopg 3 for python3 (the README's Python example is tested)"
        python3 -m pip install --quiet --disable-pip-version-check "psycopg[binary]>=3.1,<3.3" >&2 \
            || python3 -m pip install --quiet --user "psycopg[binary]>=3.1,<3.3" >&2
    fi
}

# promtool checks and unit-tests deploy/prometheus/alerts.yml (outbox-cli/tests/ops_kit.rs).
# Only the tool is taken from Debian's `prometheus` package (`apt-get download`, unpacked into
# the state directory), so no Prometheus server is installed or started.
ensure_promtool() {
    if [[ -n "${PROMTOOL:-}" && -x "$PROMTOOL" ]]; then return; fi
    local bin
    bin="$(command -v promtool || true)"
    local cached="$OUTBOX_STATE_DIR/promtool/usr/bin/promtool"
    if [[ -z "$bin" && -x "$cached" ]]; then bin="$cached"; fi
    if [[ -z "$bin" ]]; then
        if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
            log "fetching promtool (Debian's prometheus package, unpacked; no server installed)"
            local tmp
            tmp="$(mktemp -d)"
            if ! (cd "$tmp" && apt-get download prometheus >&2); then
                if [[ "$(id -u)" == 0 ]]; then
                    apt-get update -q >&2
                    (cd "$tmp" && apt-get download prometheus >&2)
                fi
            fi
            if ls "$tmp"/prometheus_*.deb >/dev/null 2>&1; then
                dpkg-deb -x "$tmp"/prometheus_*.deb "$OUTBOX_STATE_DIR/promtool"
                bin="$cached"
            fi
            rm -rf "$tmp"
        fi
        if [[ -z "$bin" || ! -x "$bin" ]]; then
            echo "error: promtool is not installed (it checks deploy/prometheus/alerts.yml)." >&2
            echo "       Install it (apt-get install prometheus, or the release archive from" >&2
            echo "       prometheus.io) or set PROMTOOL." >&2
            exit 1
        fi
    fi
    export PROMTOOL="$bin"
}

stop_services() {
    if [[ -n "$TANSU_PID" ]]; then
        kill "$TANSU_PID" 2>/dev/null || true
        wait "$TANSU_PID" 2>/dev/null || true
    fi
}
