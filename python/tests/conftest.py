import pytest


def pytest_report_header(config):
    import strata

    lines = [f"strata {strata.__version__}, kernels: {strata.ISA}"]
    try:
        import torch

        lines.append(f"torch {torch.__version__}")
    except ImportError as err:
        lines.append(f"torch not importable ({err}): torch tests skip")
    return lines
