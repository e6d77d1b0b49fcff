package main

import (
	"flag"
	"io"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

// readmeTable returns the rows, header and rule left out, of README's first
// table after the text after.
func readmeTable(t *testing.T, after string) []string {
	t.Helper()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(readme), after)
	if !ok {
		t.Fatalf("README has no %q", after)
	}
	var rows []string
	for line := range strings.SplitSeq(rest, "\n") {
		switch {
		case strings.HasPrefix(line, "|"):
			rows = append(rows, line)
		case len(rows) > 0:
			return rows[2:] // header and rule
		}
	}
	t.Fatalf("README: no table after %q", after)
	return nil
}

var (
	reFlag     = regexp.MustCompile("`--([a-z-]+)`")
	reEnv      = regexp.MustCompile(`\[([A-Z_, ]+)\]`)
	reBacktick = regexp.MustCompile("`([^`]*)`")
	reCommand  = regexp.MustCompile("^\\| `gpu-agent ([a-z-]+(?: [a-z]+)?)")
	reUsageCmd = regexp.MustCompile(`(?m)^  gpu-agent ([a-z-]+(?: [a-z]+)?)`)
)

// README's flags table is `gpu-agent run`'s flags, each with its
// environment variable and, where the table gives one literally, its
// default: a flag added without a row, or a row for a flag that is gone,
// fails.
func TestReadmeRunFlagsTable(t *testing.T) {
	var f runFlags
	fs, err := runFlagSet(&f, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	envOf := map[string]string{}
	fs.VisitAll(func(fl *flag.Flag) {
		if m := reEnv.FindStringSubmatch(fl.Usage); m != nil {
			envOf[fl.Name] = m[1]
			t.Setenv(m[1], "") // defaults as without the environment
		}
	})
	fs, _ = runFlagSet(&f, io.Discard)

	documented := map[string]bool{}
	for _, row := range readmeTable(t, "`gpu-agent run` flags") {
		cells := strings.Split(row, "|")
		if len(cells) < 4 {
			t.Errorf("README flags row %q: want flag, default, description", row)
			continue
		}
		var names []string
		for _, m := range reFlag.FindAllStringSubmatch(cells[1], -1) {
			names = append(names, m[1])
		}
		var envs []string
		if m := reEnv.FindStringSubmatch(cells[1]); m != nil {
			envs = strings.Split(m[1], ", ")
		}
		defaults := reBacktick.FindAllStringSubmatch(cells[2], -1)
		for i, name := range names {
			documented[name] = true
			fl := fs.Lookup(name)
			if fl == nil {
				t.Errorf("README documents --%s, which `gpu-agent run` does not have", name)
				continue
			}
			if len(envs) != len(names) || envs[i] != envOf[name] {
				t.Errorf("README: --%s [%s], the flag's variable is %s", name, strings.Join(envs, ", "), envOf[name])
			}
			if len(defaults) == len(names) && !sameDefault(defaults[i][1], fl.DefValue) {
				t.Errorf("README: --%s defaults to `%s`, the flag to %q", name, defaults[i][1], fl.DefValue)
			}
		}
	}
	fs.VisitAll(func(fl *flag.Flag) {
		if !documented[fl.Name] {
			t.Errorf("`gpu-agent run --%s` has no row in README's flags table", fl.Name)
		}
	})
}

// README's Commands table lists the commands of `gpu-agent --help`, no more.
func TestReadmeCommandsTable(t *testing.T) {
	var inUsage, inReadme []string
	for _, m := range reUsageCmd.FindAllStringSubmatch(usage, -1) {
		inUsage = append(inUsage, strings.TrimSuffix(m[1], " "))
	}
	for _, row := range readmeTable(t, "## Commands") {
		if m := reCommand.FindStringSubmatch(row); m != nil {
			inReadme = append(inReadme, m[1])
		} else {
			t.Errorf("README Commands row %q does not start with a gpu-agent command", row)
		}
	}
	sort.Strings(inUsage)
	sort.Strings(inReadme)
	if len(inUsage) < 8 || !slices.Equal(inUsage, inReadme) {
		t.Errorf("README's Commands table lists %q, `gpu-agent --help` %q", inReadme, inUsage)
	}
}

// sameDefault compares a default as README writes it with the flag's
// (durations as durations: 24h is 24h0m0s).
func sameDefault(readme, flagDef string) bool {
	if readme == flagDef {
		return true
	}
	a, errA := time.ParseDuration(readme)
	b, errB := time.ParseDuration(flagDef)
	return errA == nil && errB == nil && a == b
}
