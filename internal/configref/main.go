// Command configref writes docs/config-reference.md, the reference of every
// config field, from package config: fields, YAML names, types and the
// defaults Parse fills in by reflection over config.File, and what each field
// does, its stated defaults and allowed values from the doc comments and
// constants of config/types.go. Run it from the repository root:
//
//	go run ./internal/configref
//
// TestReferenceIsCurrent fails while the committed page differs from what it
// writes.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	src := flag.String("src", "config/types.go", "the config types' source file")
	out := flag.String("o", "docs/config-reference.md", "where to write the reference")
	flag.Parse()
	page, err := generate(*src)
	if err != nil {
		fmt.Fprintf(os.Stderr, "configref: %v (run it from the repository root)\n", err)
		os.Exit(1)
	}
	if err := os.WriteFile(*out, page, 0o644); err != nil {
		fmt.Fprintf(os.Stderr, "configref: %v\n", err)
		os.Exit(1)
	}
}
