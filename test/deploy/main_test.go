package deploy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// agentBin is the gpu-agent binary built once by TestMain: the examples, the
// flag coverage and the DaemonSet run all need the real CLI, and building it
// per test would cost a cgo link each time. Set once, read only afterwards.
var agentBin string

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "gpu-agent-deploy-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	agentBin = filepath.Join(dir, "gpu-agent")
	cmd := exec.Command("go", "build", "-o", agentBin, "./cmd/gpu-agent")
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "CGO_CFLAGS=-Wno-deprecated-declarations")
	if out, err := cmd.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build gpu-agent: %v\n%s", err, out)
		return 1
	}
	return m.Run()
}

// repoRoot is the gpu-agent repository, two levels up from this module.
const repoRoot = "../.."

// repoPath joins parts under the repository root.
func repoPath(parts ...string) string {
	return filepath.Join(append([]string{repoRoot}, parts...)...)
}
