"""tools/test.sh's pytest-xdist scheduling: a test file per worker, a folder of shared session fixtures whole."""

from __future__ import annotations

from ds_harness.scheduling import unit_of


def test_a_listed_folder_is_one_unit_and_any_other_test_its_file() -> None:
    folders = ("tests/a/shared/", )
    assert unit_of("tests/a/shared/test_x.py::test_one[zero0]", folders) == "tests/a/shared/"
    assert unit_of("tests/a/shared/test_y.py::test_two", folders) == "tests/a/shared/"
    assert unit_of("tests/a/test_z.py::test_three[zero0]", folders) == "tests/a/test_z.py"
    assert unit_of("tests/a/test_z.py::TestClass::test_five", folders) == "tests/a/test_z.py"
    assert unit_of("tests/a/shared_not/test_w.py::test_four", folders) == "tests/a/shared_not/test_w.py"
