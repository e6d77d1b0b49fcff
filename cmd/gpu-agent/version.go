package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-agent/gpu-agent/agent"
)

// version and commit are set at link time (-ldflags "-X main.version=v1.2.0
// -X main.commit=..."; the Makefile and the Dockerfile do). A build from a
// git checkout carries its commit in its build info, which wins; an image
// is built without .git, so commit is its only source there.
var (
	version = ""
	commit  = ""
)

// buildInfo says what is running: the linked version, else the module
// version `go install` records; the VCS commit (with "-dirty" for a
// modified tree), else the linked one; the Go toolchain.
func buildInfo() agent.BuildInfo {
	info, _ := debug.ReadBuildInfo()
	return buildInfoFrom(version, commit, info)
}

func buildInfoFrom(linkedVersion, linkedCommit string, info *debug.BuildInfo) agent.BuildInfo {
	b := agent.BuildInfo{Version: linkedVersion, Commit: linkedCommit, GoVersion: runtime.Version()}
	if info != nil {
		b.GoVersion = info.GoVersion
		if b.Version == "" && info.Main.Version != "" && info.Main.Version != "(devel)" {
			b.Version = info.Main.Version
		}
		var revision string
		modified := false
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				revision = s.Value
			case "vcs.modified":
				modified = s.Value == "true"
			}
		}
		if revision != "" {
			b.Commit = revision
			if modified {
				b.Commit += "-dirty"
			}
		}
	}
	if b.Version == "" {
		b.Version = "dev"
	}
	if b.Commit == "" {
		b.Commit = "unknown"
	}
	return b
}

// cmdVersion runs `gpu-agent version` (and `--version`).
func cmdVersion(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("version", "version", stderr)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("unexpected arguments: %v", fs.Args())}
	}
	b := buildInfo()
	fmt.Fprintf(stdout, "gpu-agent %s (commit %s, %s)\n", b.Version, b.Commit, b.GoVersion)
	return nil
}

// newBuildInfoMetric is gpu_agent_build_info: always 1, its labels say what
// runs, the way Prometheus' own *_build_info series do, so a dashboard can
// join any series to the version on its node.
func newBuildInfoMetric(b agent.BuildInfo) prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "gpu_agent_build_info",
		Help:        "Always 1; the labels say which gpu-agent build runs: version, commit, goversion.",
		ConstLabels: prometheus.Labels{"version": b.Version, "commit": b.Commit, "goversion": b.GoVersion},
	}, func() float64 { return 1 })
}
