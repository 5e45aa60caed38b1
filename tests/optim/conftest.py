import os
import sys

# Let the test modules import the stand-ins and helpers beside them, also in forked ranks.
_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)
