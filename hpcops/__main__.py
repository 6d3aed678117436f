from hpcops.cli import main

raise SystemExit(main())
