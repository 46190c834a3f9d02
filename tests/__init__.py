"""The test suite; ``tests.support`` holds what several test modules share."""
