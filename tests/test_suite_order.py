"""`make test`'s order: the timing table and the Ray modules name test modules that exist, so a
renamed module cannot silently drop out of the order or run its Ray nodes beside another's."""

from __future__ import annotations

from pathlib import Path

from conftest import RAY_MODULES, module_seconds, work_unit

ROOT = Path(__file__).resolve().parents[1]


def test_the_timing_table_and_the_ray_modules_name_test_modules_that_exist() -> None:
    listed = list(module_seconds())
    assert listed, "tests/module_seconds.txt lists no module"
    missing = [m for m in [*listed, *RAY_MODULES] if not (ROOT / m).is_file()]
    assert missing == [], f"remake tests/module_seconds.txt (its header says how): {missing}"


def test_the_ray_modules_are_one_work_unit_and_the_others_their_own() -> None:
    units = {work_unit(f"{module}::test_x") for module in RAY_MODULES}
    assert len(units) == 1
    assert work_unit("tests/test_stack.py::test_x") == "tests/test_stack.py"
