import sys, re, collections
path, root_pat = sys.argv[1], sys.argv[2]
minc = int(sys.argv[3]) if len(sys.argv) > 3 else 40
maxd = int(sys.argv[4]) if len(sys.argv) > 4 else 30
tree = {}
def clean(fr):
    return [f for f in fr if '<frozen importlib' not in f and not f.startswith('_call_with_frames_removed')]
tot = 0
for line in open(path):
    stack, n = line.rstrip('\n').rsplit(' ', 1)
    n = int(n)
    frames = stack.split(';')
    if not frames[0].startswith(root_pat):
        continue
    tot += n
    node = tree
    for f in clean(frames)[:maxd]:
        f = re.sub(r'/opt/torch/.venv/lib/python3.12/site-packages/|/tmp/site/|/tmp/site-bench/', '', f)
        e = node.setdefault(f, [0, {}]); e[0] += n; node = e[1]
print('total', tot)
def show(node, depth):
    for f, (c, ch) in sorted(node.items(), key=lambda kv: -kv[1][0]):
        if c < minc: continue
        print('  ' * depth + f'{c/100:6.2f} {f}')
        # collapse single-child chains
        show(ch, depth + 1)
show(tree, 0)
