package main

import (
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
	"unicode"
)

// docTable returns the rows, header and rule left out, of the first table
// after the text after in page (a path from the repository root).
func docTable(t *testing.T, page, after string) []string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join("../..", page))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(doc), after)
	if !ok {
		t.Fatalf("%s has no %q", page, after)
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
	t.Fatalf("%s: no table after %q", page, after)
	return nil
}

// commandsDoc is the page with the commands and run's flags.
const commandsDoc = "docs/commands.md"

var (
	reFlag     = regexp.MustCompile("`--([a-z-]+)`")
	reEnv      = regexp.MustCompile(`\[([A-Z_, ]+)\]`)
	reBacktick = regexp.MustCompile("`([^`]*)`")
	reCommand  = regexp.MustCompile("^\\| `gpu-agent ([a-z-]+(?: [a-z]+)?)")
	reUsageCmd = regexp.MustCompile(`(?m)^  gpu-agent ([a-z-]+(?: [a-z]+)?)`)
)

// docs/commands.md's flags table is `gpu-agent run`'s flags, each with its
// environment variable and, where the table gives one literally, its
// default: a flag added without a row, or a row for a flag that is gone,
// fails.
func TestCommandsDocRunFlagsTable(t *testing.T) {
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
	for _, row := range docTable(t, commandsDoc, "`gpu-agent run` flags") {
		cells := strings.Split(row, "|")
		if len(cells) < 4 {
			t.Errorf("%s flags row %q: want flag, default, description", commandsDoc, row)
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
				t.Errorf("%s documents --%s, which `gpu-agent run` does not have", commandsDoc, name)
				continue
			}
			if len(envs) != len(names) || envs[i] != envOf[name] {
				t.Errorf("%s: --%s [%s], the flag's variable is %s", commandsDoc, name, strings.Join(envs, ", "), envOf[name])
			}
			if len(defaults) == len(names) && !sameDefault(defaults[i][1], fl.DefValue) {
				t.Errorf("%s: --%s defaults to `%s`, the flag to %q", commandsDoc, name, defaults[i][1], fl.DefValue)
			}
		}
	}
	fs.VisitAll(func(fl *flag.Flag) {
		if !documented[fl.Name] {
			t.Errorf("`gpu-agent run --%s` has no row in %s's flags table", fl.Name, commandsDoc)
		}
	})
}

// docs/commands.md's Commands table lists the commands of `gpu-agent --help`, no more.
func TestCommandsDocCommandsTable(t *testing.T) {
	var inUsage, inReadme []string
	for _, m := range reUsageCmd.FindAllStringSubmatch(usage, -1) {
		inUsage = append(inUsage, strings.TrimSuffix(m[1], " "))
	}
	for _, row := range docTable(t, commandsDoc, "# Commands\n") {
		if m := reCommand.FindStringSubmatch(row); m != nil {
			inReadme = append(inReadme, m[1])
		} else {
			t.Errorf("%s Commands row %q does not start with a gpu-agent command", commandsDoc, row)
		}
	}
	sort.Strings(inUsage)
	sort.Strings(inReadme)
	if len(inUsage) < 8 || !slices.Equal(inUsage, inReadme) {
		t.Errorf("%s's Commands table lists %q, `gpu-agent --help` %q", commandsDoc, inReadme, inUsage)
	}
}

// sameDefault compares a default as the docs write it with the flag's
// (durations as durations: 24h is 24h0m0s).
func sameDefault(readme, flagDef string) bool {
	if readme == flagDef {
		return true
	}
	a, errA := time.ParseDuration(readme)
	b, errB := time.ParseDuration(flagDef)
	return errA == nil && errB == nil && a == b
}

var (
	reMDLink    = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	reMDHeading = regexp.MustCompile(`(?m)^#{1,6} (.+)$`)
	reMDAnchor  = regexp.MustCompile(`<a id="([^"]+)">`)
	reMDFence   = regexp.MustCompile("(?ms)^```.*?^```")
)

// mdAnchors are the anchors a Markdown page has as GitHub renders it:
// each heading's slug (lower case, punctuation dropped, spaces as hyphens)
// and each <a id>.
func mdAnchors(doc string) map[string]bool {
	anchors := map[string]bool{}
	for _, m := range reMDAnchor.FindAllStringSubmatch(doc, -1) {
		anchors[m[1]] = true
	}
	for _, m := range reMDHeading.FindAllStringSubmatch(reMDFence.ReplaceAllString(doc, ""), -1) {
		var b strings.Builder
		for _, r := range strings.ToLower(strings.TrimSpace(m[1])) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		anchors[b.String()] = true
	}
	return anchors
}

// The manual is README and docs/, which link to each other by file and
// heading: moving a section must not leave a link to where it was.
func TestDocLinks(t *testing.T) {
	pages, err := filepath.Glob("../../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	pages = append(pages, "../../README.md", "../../ARCHITECTURE.md", "../../deploy/README.md")
	checked := 0
	for _, page := range pages {
		src, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range reMDLink.FindAllStringSubmatch(reMDFence.ReplaceAllString(string(src), ""), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			path := page
			if file != "" {
				path = filepath.Join(filepath.Dir(page), file)
			}
			checked++
			if _, err := os.Stat(path); err != nil {
				t.Errorf("%s links to %s, which does not exist", page, target)
				continue
			}
			if anchor == "" || !strings.HasSuffix(path, ".md") {
				continue
			}
			doc, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			if !mdAnchors(string(doc))[anchor] {
				t.Errorf("%s links to %s: %s has no heading #%s", page, target, path, anchor)
			}
		}
	}
	if checked < 20 {
		t.Errorf("checked %d links, want the manual's (at least 20)", checked)
	}
}
