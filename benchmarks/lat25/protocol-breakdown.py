# usage: zcat kafka-protocol-debug.log.gz | python3 protocol-breakdown.py
# librdkafka debug=protocol lines of two producers run one after the other (CorrId restarts):
# ProduceRequests per publish burst, their round trips by position, first send -> last response.
import re, statistics, datetime, sys
rows = []
for l in sys.stdin:
    m = re.match(r'(\S+)Z DEBUG librdkafka: \[thrd:([^\]]+)\]: .*?(Sent|Received) Produce(Request|Response) \(v\d+, (\d+) bytes.*?CorrId (\d+)(?:, rtt ([\d.]+)ms)?', l)
    if m:
        rows.append((datetime.datetime.fromisoformat(m.group(1)), m.group(3), int(m.group(6)), float(m.group(7)) if m.group(7) else None))
parts, last = [[]], 0
for r in rows:
    if r[1] == 'Sent' and r[2] < last - 100:
        parts.append([])
    if r[1] == 'Sent':
        last = r[2]
    parts[-1].append(r)
for name, rs in zip(('notify (librdkafka default, Nagle on)', 'notify-nagle (socket.nagle.disable=true)'), parts):
    sends = {r[2]: r[0] for r in rs if r[1] == 'Sent'}
    recv = {r[2]: (r[0], r[3]) for r in rs if r[1] == 'Received'}
    rtt = [v[1] for v in recv.values()]
    ids = sorted(sends, key=lambda c: sends[c])
    bursts, cur = [], [ids[0]]
    for c in ids[1:]:
        if (sends[c] - sends[cur[-1]]).total_seconds() < 0.001:
            cur.append(c)
        else:
            bursts.append(cur); cur = [c]
    bursts.append(cur)
    span = [(max(recv[c][0] for c in b) - sends[b[0]]).total_seconds() * 1e3 for b in bursts if all(c in recv for c in b)]
    bypos = {}
    for b in bursts:
        for k, c in enumerate(b):
            if c in recv:
                bypos.setdefault(min(k, 5), []).append(recv[c][1])
    print(name, 'requests', len(rtt), 'rtt p50 %.2f' % statistics.median(rtt), 'bursts', len(bursts),
          'requests/burst %.2f' % statistics.mean(len(b) for b in bursts),
          'first send->last response p50 %.2f ms' % statistics.median(span))
    print('   rtt p50 by position in the burst:', {k: round(statistics.median(v), 2) for k, v in sorted(bypos.items())})
