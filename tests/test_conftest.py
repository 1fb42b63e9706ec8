"""conftest.py's --every selection (CI's jax 0.11 pass)."""

import dataclasses

from helpers import every_nth


@dataclasses.dataclass
class _Item:
  path: str
  originalname: str
  name: str
  gpu: bool = False
  cls: type | None = None

  def get_closest_marker(self, name):
    return object() if name == "gpu" and self.gpu else None


def test_every_nth_keeps_each_functions_first_and_every_nth_case_and_all_gpu_cases():
  class Suite:
    pass
  items = ([_Item("a.py", "f", f"f[cpu-{i}]") for i in range(7)] +
           [_Item("a.py", "f", f"f[gpu-{i}]", gpu=True) for i in range(3)] +
           [_Item("a.py", "g", "g")] +
           [_Item("b.py", "f", f"f[{i}]") for i in range(4)] +
           [_Item("b.py", "f", f"f[{i}]", cls=Suite) for i in range(2)])
  keep, drop = every_nth(items, 3)
  assert [i.name for i in keep] == (["f[cpu-0]", "f[cpu-3]", "f[cpu-6]"] +
                                    [f"f[gpu-{i}]" for i in range(3)] +
                                    ["g", "f[0]", "f[3]", "f[0]"])
  assert len(keep) + len(drop) == len(items)
  assert every_nth(items, 1) == (items, [])


def test_every_nth_with_an_offset_takes_the_other_cases():
  items = [_Item("a.py", "f", f"f[{i}]") for i in range(7)] + [_Item("a.py", "g", "g")]
  keep, _ = every_nth(items, 6, offset=1)
  assert [i.name for i in keep] == ["f[1]", "g"]
  first, _ = every_nth(items, 3)
  assert not {i.name for i in keep[:1]} & {i.name for i in first}
