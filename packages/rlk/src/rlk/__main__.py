from rlk.app.cli import main

raise SystemExit(main())
