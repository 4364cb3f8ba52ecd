# SPDX-License-Identifier: Apache-2.0
"""Test beds shared by the tests and the benchmarks; never imported by the library itself."""
