import sys, importlib.abc, traceback, os
class Hook(importlib.abc.MetaPathFinder):
    seen = set()
    def find_spec(self, name, path=None, target=None):
        if name in ('torch._inductor.compile_fx', 'functorch.compile', 'deepspeed.runtime.zero.muon.original_muon') and name not in Hook.seen:
            Hook.seen.add(name)
            with open(os.environ.get('HOOK_OUT', '/tmp/hookstack.txt'), 'a') as f:
                f.write(f'===== {name}\n' + ''.join(traceback.format_stack()))
        return None
sys.meta_path.insert(0, Hook())
