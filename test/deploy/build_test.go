package deploy

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// make build without cgo stops at once with a message saying why, instead
// of go-nvml's "undefined: Return" minutes into the build.
func TestMakeBuildWithoutCgo(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("no make")
	}
	cmd := exec.Command("make", "build", "BIN="+t.TempDir()+"/gpu-agent")
	cmd.Dir = repoRoot
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	if err == nil {
		t.Fatalf("make build with CGO_ENABLED=0 succeeded:\n%s", out)
	}
	if !strings.Contains(string(out), "gpu-agent needs cgo") || strings.Contains(string(out), "undefined: Return") {
		t.Errorf("output:\n%s\nwant the cgo message, before any compile", out)
	}
}
