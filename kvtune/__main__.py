from kvtune.tuner.cli import main

raise SystemExit(main())
