package deploy

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// instruction is one Dockerfile instruction with continuation lines joined.
type instruction struct {
	cmd, args string
	line      int
}

// parseDockerfile splits a Dockerfile into instructions (comments dropped,
// backslash continuations joined); enough to assert what `make image` relies on
// on machines that have no Docker engine to build it.
func parseDockerfile(data string) []instruction {
	var out []instruction
	var cur strings.Builder
	start := 0
	for i, line := range strings.Split(data, "\n") {
		trimmed := strings.TrimSpace(line)
		if cur.Len() == 0 && (trimmed == "" || strings.HasPrefix(trimmed, "#")) {
			continue
		}
		if cur.Len() == 0 {
			start = i + 1
		}
		if strings.HasSuffix(trimmed, "\\") {
			cur.WriteString(strings.TrimSuffix(trimmed, "\\") + " ")
			continue
		}
		cur.WriteString(trimmed)
		cmd, args, _ := strings.Cut(cur.String(), " ")
		out = append(out, instruction{strings.ToUpper(cmd), strings.TrimSpace(args), start})
		cur.Reset()
	}
	return out
}

func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile(repoPath("Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	gomod, err := os.ReadFile(repoPath("go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	goVersion := regexp.MustCompile(`(?m)^go (\S+)$`).FindSubmatch(gomod)
	if goVersion == nil {
		t.Fatal("no go directive in go.mod")
	}

	ins := parseDockerfile(string(data))
	args := map[string]string{}
	var froms []instruction
	stages := map[string]bool{}
	for _, in := range ins {
		switch in.cmd {
		case "ARG":
			if k, v, ok := strings.Cut(in.args, "="); ok && len(froms) == 0 {
				args[k] = v
			}
		case "FROM":
			froms = append(froms, in)
			if f := strings.Fields(in.args); len(f) == 3 && strings.EqualFold(f[1], "AS") {
				stages[f[2]] = true
			}
		}
	}
	if len(froms) != 2 {
		t.Fatalf("%d FROM stages, want 2 (build, runtime)", len(froms))
	}
	expand := func(s string) string {
		return regexp.MustCompile(`\$\{(\w+)\}`).ReplaceAllStringFunc(s, func(m string) string { return args[m[2:len(m)-1]] })
	}
	builder := expand(strings.Fields(froms[0].args)[0])
	if want := "golang:" + string(goVersion[1]) + "-"; !strings.HasPrefix(builder, want) {
		t.Errorf("builder image %s, want the go.mod toolchain pinned: %s<debian release>", builder, want)
	}
	runtime := strings.Fields(froms[1].args)[0]
	if !strings.HasPrefix(runtime, "gcr.io/distroless/base-") {
		t.Errorf("runtime image %s: want distroless base (glibc, which the cgo binary needs)", runtime)
	}
	// The cgo binary links against the builder's glibc; the runtime must be
	// the same Debian release.
	releases := map[string]string{"bookworm": "debian12", "trixie": "debian13"}
	rel := builder[strings.LastIndex(builder, "-")+1:]
	if want := releases[rel]; want == "" || !strings.HasSuffix(runtime, "-"+want) {
		t.Errorf("builder %s (Debian %s) and runtime %s differ in glibc", builder, rel, runtime)
	}
	for _, f := range froms {
		if strings.Contains(f.args, ":latest") {
			t.Errorf("line %d: FROM %s is not pinned", f.line, f.args)
		}
	}

	var buildRun, entrypoint string
	copiedFromBuild := false
	env := map[string]bool{}
	for _, in := range ins[slices.IndexFunc(ins, func(i instruction) bool { return i == froms[0] }):] {
		switch in.cmd {
		case "RUN":
			if strings.Contains(in.args, "go build") {
				buildRun = in.args
			}
		case "ENV":
			for _, kv := range strings.Fields(in.args) {
				env[kv] = true
			}
		case "COPY":
			if f := strings.Fields(in.args); len(f) > 0 && strings.HasPrefix(f[0], "--from=") && stages[strings.TrimPrefix(f[0], "--from=")] {
				copiedFromBuild = strings.HasSuffix(in.args, "/usr/bin/gpu-agent")
			}
		case "ENTRYPOINT":
			entrypoint = in.args
		}
	}
	if !strings.Contains(buildRun, "./cmd/gpu-agent") {
		t.Errorf("no RUN go build of ./cmd/gpu-agent (got %q)", buildRun)
	}
	// The context has no .git: without these the image reports version
	// "dev" and commit "unknown" (gpu-agent version, /status, gpu_agent_build_info).
	for _, x := range []string{"-X main.version=${VERSION}", "-X main.commit=${COMMIT}"} {
		if !strings.Contains(buildRun, x) {
			t.Errorf("go build does not link %s (got %q)", x, buildRun)
		}
	}
	for _, e := range []string{"CGO_ENABLED=1", "CGO_CFLAGS=-Wno-deprecated-declarations", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=utility"} {
		if !env[e] {
			t.Errorf("ENV %s missing", e)
		}
	}
	if !copiedFromBuild {
		t.Error("the runtime stage does not COPY the binary from the build stage to /usr/bin/gpu-agent")
	}
	if entrypoint != `["/usr/bin/gpu-agent"]` {
		t.Errorf("ENTRYPOINT %s, want exec form [\"/usr/bin/gpu-agent\"] so signals reach the agent", entrypoint)
	}
	if strings.Contains(string(data), "libnvidia-ml") && strings.Contains(string(data), "COPY") &&
		regexp.MustCompile(`(?m)^COPY.*libnvidia-ml`).Match(data) {
		t.Error("the image must not carry libnvidia-ml: it has to match the host driver")
	}
}

func TestParseDockerfile(t *testing.T) {
	got := parseDockerfile("# c\nFROM a AS b\n\nRUN x \\\n  && y\nenv A=1\n")
	want := []instruction{{"FROM", "a AS b", 2}, {"RUN", "x  && y", 4}, {"ENV", "A=1", 6}}
	if !slices.Equal(got, want) {
		t.Errorf("parseDockerfile = %+v, want %+v", got, want)
	}
}
