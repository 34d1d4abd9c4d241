from rlk.cli import main

raise SystemExit(main())
