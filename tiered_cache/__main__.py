from tiered_cache.cli import main

raise SystemExit(main())
