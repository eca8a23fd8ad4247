# Sourced by scripts/test and scripts/demo-real: start PostgreSQL, a Kafka-protocol broker, NATS
# with JetStream and RabbitMQ.
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

stop_services() {
    if [[ -n "$TANSU_PID" ]]; then
        kill "$TANSU_PID" 2>/dev/null || true
        wait "$TANSU_PID" 2>/dev/null || true
    fi
}
