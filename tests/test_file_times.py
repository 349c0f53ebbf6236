"""tests/file_times.json, the measured times that order the files (tests/conftest.py):
it lists exactly the test files there are, and the collection runs them longest first."""

import glob
import os

from conftest import REPO, file_of, measured_file_times

TESTS = os.path.join(REPO, "tests")


def test_every_test_file_is_measured_and_none_that_is_gone():
    files = {os.path.relpath(p, TESTS).replace(os.sep, "/")
             for p in glob.glob(os.path.join(TESTS, "**", "test_*.py"), recursive=True)}
    times = measured_file_times()
    assert not files - set(times), (
        f"not measured: {sorted(files - set(times))}; run the suite with "
        "JAXFORMER_RECORD_FILE_TIMES=tests/file_times.json")
    assert not set(times) - files, f"measured but gone: {sorted(set(times) - files)}"
    assert all(isinstance(t, (int, float)) and t >= 0 for t in times.values())


def test_the_files_are_collected_longest_first(request):
    times = measured_file_times()
    order = []
    for item in request.session.items:
        if not order or order[-1] != file_of(item):
            order.append(file_of(item))
    assert len(order) == len(set(order))  # each file's tests together
    ran = [times.get(f, float("inf")) for f in order]
    assert ran == sorted(ran, reverse=True)
