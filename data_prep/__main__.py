import sys

from data_prep.tokenize_corpus import main

sys.exit(main())
