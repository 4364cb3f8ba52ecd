# SPDX-License-Identifier: Apache-2.0
"""What every layer speaks: the description of a call (description.py), element types (dtypes.py), reduction
operations (ops.py), arrays as the C core takes them (buffers.py) and the errors the library raises (exceptions.py)."""
