import re,sys,collections,statistics
rx=re.compile(r'^(\S+ \S+) UTC \[(\d+)\] \S+ LOG:  duration: ([\d.]+) ms  (statement|parse|bind|execute)( [^:]*)?: (.*)$')
entries=[]
for line in open(sys.argv[1]):
    m=rx.match(line)
    if m: entries.append((m.group(2),float(m.group(3)),m.group(4),m.group(6)))
bypid=collections.defaultdict(list)
for e in entries: bypid[e[0]].append(e)
def kind_of(text):
    if 'synchronous_commit = on; SELECT pg_advisory_xact_lock_shared' in text: return 'claim'
    if 'synchronous_commit = off' in text and text.startswith('BEGIN'): return 'completion'
    return None
def label(text):
    t=text.strip()
    if t.startswith('BEGIN'): return 'BEGIN+SETs'
    if t.startswith('COMMIT'): return 'COMMIT'
    if 'pg_advisory_xact_lock(s.k)' in t: return 'lock_keys'
    if 'ORDER BY c.id LIMIT' in t: return 'candidates'
    if 'pg_advisory_unlock' in t: return 'gate disarm'
    return t[:60]
# per transaction: list of (label, phase, dur)
tx=collections.defaultdict(lambda: collections.defaultdict(list))
ntx=collections.Counter()
for pid,es in bypid.items():
    cur=None; acc=None
    for (_,d,phase,text) in es:
        k=kind_of(text) if phase=='statement' else None
        if k:
            cur=k; acc=collections.defaultdict(float); ntx[k]+=1
        if cur is None: continue
        l=label(text)
        if l not in ('BEGIN+SETs','COMMIT','lock_keys','candidates','gate disarm'):
            # statement texts of the decide / complete
            l = ('decide' if cur=='claim' else 'complete_lease') if len(text)>200 else l
        acc[(l,phase)]+=d
        if l=='COMMIT':
            for key,v in acc.items(): tx[cur][key].append(v)
            cur=None
for k in tx:
    print(f'== {k}: {ntx[k]} transactions')
    tot=collections.defaultdict(float)
    for key,v in sorted(tx[k].items(), key=lambda kv: -statistics.median(kv[1])):
        print(f'   {key[0]:<16} {key[1]:<9} n={len(v):5d} p50 {statistics.median(v):7.3f} ms  mean {statistics.mean(v):7.3f}  p90 {sorted(v)[int(0.9*len(v))]:7.3f}')
# appends
commits=[d for (_,d,ph,t) in entries if t.strip()=='COMMIT']
print('all COMMIT p50', statistics.median(commits), 'n', len(commits))
