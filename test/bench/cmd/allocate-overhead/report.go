package main

import (
	"fmt"
	"io"
	"runtime/debug"
	"slices"
	"strings"
)

var readBuildInfo = debug.ReadBuildInfo

// report prints the results as markdown tables: latency, then what else is
// known of each agent.
func report(w io.Writer, o options, agents []*agentProc, results []map[string]*series, facts []agentFacts, bareAlloc, barePref int, load0, load1 string) {
	fmt.Fprintf(w, "\nload average (1 min) %s before, %s after; %d busy loop(s)\n\n", load0, load1, o.load)
	fmt.Fprintln(w, "| agent | call | p50 ratio, median | min–max | agent p50 (µs) | bare p50 (µs) | agent p99 (µs) | bare p99 (µs) | agent CPU per call (µs) | bare CPU per call (µs) |")
	fmt.Fprintln(w, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
	for i, a := range agents {
		for _, call := range o.kinds {
			s := results[i][call]
			bareCPU := "–"
			if !o.bareInProcess {
				bareCPU = fmt.Sprintf("%.0f", micros(s.bareCPU)/float64(s.calls))
			}
			fmt.Fprintf(w, "| %s | %s | %.2f | %.2f–%.2f | %.0f | %.0f | %.0f | %.0f | %.0f | %s |\n", a.label, call,
				median(s.ratio), slices.Min(s.ratio), slices.Max(s.ratio),
				median(s.agentP50), median(s.bareP50), median(s.agentP99), median(s.bareP99),
				micros(s.agentCPU)/float64(s.calls), bareCPU)
		}
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| agent | binary | Go | grpc | kubelet API | Allocate answer (bytes) | GetPreferredAllocation answer (bytes) | allocations.log at the end | pod-resources Lists |")
	fmt.Fprintln(w, "|---|---|---|---|---|---:|---:|---:|---:|")
	for i, a := range agents {
		f := facts[i]
		logSize := "none"
		if f.logSize >= 0 {
			logSize = humanBytes(f.logSize)
		}
		path := a.path
		if a.noSimState {
			path += " (no sim state=)"
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %d | %d | %s | %d |\n", a.label, path, orUnknown(f.goVersion), orUnknown(f.grpc), orUnknown(f.kubelet),
			f.allocSize, f.prefSize, logSize, f.lists)
	}
	fmt.Fprintf(w, "| bare | this command | %s | %s | %s | %d | %d | – | – |\n", runtimeVersion(), selfDep("google.golang.org/grpc"), selfDep("k8s.io/kubelet"), bareAlloc, barePref)
}

func orUnknown(s string) string {
	if s == "" {
		return "?"
	}
	return s
}

func humanBytes(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// selfDep is the version of module path this command is built with.
func selfDep(path string) string {
	if bi, ok := readBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == path {
				if d.Replace != nil && d.Replace.Version != "" {
					return d.Replace.Version
				}
				return d.Version
			}
		}
	}
	return "?"
}

func runtimeVersion() string {
	if bi, ok := readBuildInfo(); ok {
		return strings.TrimSpace(bi.GoVersion)
	}
	return "?"
}
