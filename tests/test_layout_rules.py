"""Rules on how the test tree is laid out, checked so they stay true."""
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
MAX_TEST_FILE_LINES = 1000


def test_no_test_file_is_over_the_line_limit():
    """A test module longer than this is split by topic (shared fixtures in its folder's conftest.py)."""
    long = {str(p.relative_to(TESTS)): n for p in sorted(TESTS.rglob("test_*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_TEST_FILE_LINES}
    assert not long, f"test files over {MAX_TEST_FILE_LINES} lines: {long}"
