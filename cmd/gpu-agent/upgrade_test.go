package main

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/plugin"
)

// After a rollback past a change of a state file's major format, the agent
// does not start without what the file records, which would destroy what
// it protects, nor set it aside, which would lose it for the newer agent
// rolled forward again: it exits, saying which file, its format, the
// formats this build reads and what to do, and leaves the file as it is.
func TestRunRefusesNewerMajorFormat(t *testing.T) {
	for _, tc := range []struct {
		file, content, says string
	}{
		{agent.CheckpointFile, `{"version":9,"minor":1,"written":"2026-11-23T00:00:00Z"}`, "format 9.1, written by a newer gpu-agent; this build reads 1.0 to 4."},
		{ledger.AllocLogFile, `{"version":3,"at":"2026-11-23T00:00:00Z","devices":[]}` + "\n", "line 1: format 3.0, written by a newer gpu-agent; this build reads 1."},
	} {
		t.Run(tc.file, func(t *testing.T) {
			dir := t.TempDir()
			state := filepath.Join(dir, "state")
			if err := os.Mkdir(state, 0o755); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(state, tc.file)
			if err := os.WriteFile(path, []byte(tc.content), 0o600); err != nil {
				t.Fatal(err)
			}
			code, _, stderr := run(t, "run", "--backend", "sim:pcie-4gpu", "--state-dir", state, "--listen", "127.0.0.1:0",
				"--device-plugin-dir", filepath.Join(dir, "dp"), "--mps-root", filepath.Join(dir, "mps"),
				"--pod-resources-socket", filepath.Join(dir, "pr.sock"), "--node-name", "n1")
			if code != 1 {
				t.Fatalf("exit %d, want 1; stderr:\n%s", code, stderr)
			}
			for _, want := range []string{path, tc.says, "left as it is for the agent that wrote it"} {
				if !strings.Contains(stderr, want) {
					t.Errorf("stderr does not say %q:\n%s", want, stderr)
				}
			}
			if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, []byte(tc.content)) {
				t.Fatalf("%s now %q, %v; want it left as it was", tc.file, got, err)
			}
			if _, err := os.Stat(path + ".unreadable"); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("set aside: %v", err)
			}
		})
	}
}

// rollbackBase is build N-1 of TestUpgradeAndRollback: the last commit
// before the state formats were versioned (issue 29), whose decoders
// refuse any field they do not know. It reads what this build writes
// because this build adds nothing yet: allocation-log records and MIG
// journals at 1.0, the checkpoint at 4.0. A change that adds a field to
// one of them bumps its minor version (docs/upgrade.md), and this test then
// fails at the rollback, as real nodes would: move rollbackBase to the
// last commit before that change, which reads newer minors.
const rollbackBase = "0db4f3d42b4afe2ec238ef1c7feb2ba6ba1ed5ac"

// Issue 29, defect 5: an upgrade and a rollback lost allocations. Real
// binaries of two commits take turns on one node's state: N-1
// (rollbackBase) allocates a GPU and records an XID 79 health cause; N
// (this tree) keeps both and allocates another; N-1 again keeps all three
// records; then the files are rewritten as a newer minor version would
// write them (fields N does not know), and N reads them all. Nothing is set
// aside at any point.
func TestUpgradeAndRollback(t *testing.T) {
	newBin := agentBinary(t)
	oldBin := buildCommit(t, rollbackBase)
	dir := t.TempDir()
	pluginDir := filepath.Join(dir, "dp")
	if err := os.Mkdir(pluginDir, 0o755); err != nil {
		t.Fatal(err)
	}
	startFakeKubelet(t, pluginDir)
	state := filepath.Join(dir, "state")
	addr := freeAddr(t)
	// No pod-resources server: no kubelet answer ever accounts for an
	// allocation, so the allocation log is all that keeps them.
	start := func(bin string) *exec.Cmd {
		t.Helper()
		cmd := exec.Command(bin, "run", "--backend", "sim:pcie-4gpu,state="+filepath.Join(dir, "sim.json"),
			"--device-plugin-dir", pluginDir, "--pod-resources-socket", filepath.Join(dir, "pr.sock"),
			"--listen", addr, "--state-dir", state, "--mps-root", filepath.Join(dir, "mps"), "--node-name", "n1")
		cmd.Stderr = &syncBuffer{}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cmd.Process.Kill()
			cmd.Wait()
			if t.Failed() {
				t.Logf("%s log:\n%s", filepath.Base(bin), cmd.Stderr.(*syncBuffer).String())
			}
		})
		return cmd
	}
	stop := func(cmd *exec.Cmd) string {
		t.Helper()
		cmd.Process.Signal(syscall.SIGTERM)
		if err := cmd.Wait(); err != nil {
			t.Fatalf("%s: %v", filepath.Base(cmd.Path), err)
		}
		return cmd.Stderr.(*syncBuffer).String()
	}
	const res = "nvidia.com/gpu"
	serving := func(xid79 bool) *agent.Status {
		t.Helper()
		return waitStatus(t, addr, fmt.Sprintf("serving 4 GPUs (GPU 3 with XID 79: %t)", xid79), func(st *agent.Status) bool {
			for _, r := range st.Resource {
				if r.Name == res && len(r.Devices) == 4 {
					return strings.Contains(r.Devices[3].Reason, "XID 79") == xid79
				}
			}
			return false
		})
	}
	allocate := func(st *agent.Status, i int) {
		t.Helper()
		conn, err := grpc.NewClient("unix://"+filepath.Join(pluginDir, plugin.DefaultSocketName(res)), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		id := st.Resource[0].Devices[i].ID
		if _, err := pluginapi.NewDevicePluginClient(conn).Allocate(ctx, &pluginapi.AllocateRequest{
			ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{id}}}}); err != nil {
			t.Fatalf("Allocate %s: %v", id, err)
		}
	}
	// kept checks what an agent's log says it restored, and that nothing
	// was set aside or skipped.
	kept := func(who, logs string, allocations int) {
		t.Helper()
		for _, want := range []string{
			`msg="allocations not yet accounted for by the kubelet restored".* allocations=` + fmt.Sprint(allocations) + ` `,
			`msg="checkpoint restored".* healthCauses=1 `,
		} {
			if !regexp.MustCompile(want).MatchString(logs) {
				t.Errorf("%s: the log does not say %s", who, want)
			}
		}
		for _, bad := range []string{"set aside", "record skipped", "not restored"} {
			if strings.Contains(logs, bad) {
				t.Errorf("%s: the log says %q", who, bad)
			}
		}
		aside, _ := filepath.Glob(filepath.Join(state, "*.unreadable"))
		if len(aside) > 0 {
			t.Errorf("%s: set aside: %v", who, aside)
		}
	}

	old := start(oldBin)
	st := serving(false)
	allocate(st, 0)
	post(t, addr, "/sim/xid", `{"gpu":3,"xid":79}`)
	serving(true)
	stop(old)

	upgraded := start(newBin)
	st = serving(true)
	allocate(st, 1)
	kept("N after N-1", stop(upgraded), 1)

	rolledBack := start(oldBin)
	serving(true)
	kept("N-1 after N", stop(rolledBack), 2)

	// As a newer minor version would write them: the version named, and a
	// field N does not know in every record.
	rewrite(t, filepath.Join(state, agent.CheckpointFile), func(b []byte) []byte {
		return append([]byte(`{"minor":7,"fromNewer":{"x":[1]},`), bytes.TrimPrefix(b, []byte("{"))...)
	})
	rewrite(t, filepath.Join(state, ledger.AllocLogFile), func(b []byte) []byte {
		return bytes.ReplaceAll(b, []byte("{\"at\""), []byte(`{"version":1,"minor":7,"fromNewer":1,"at"`))
	})
	upgraded = start(newBin)
	st = serving(true)
	allocate(st, 2)
	kept("N after N+1 (a newer minor)", stop(upgraded), 2)
}

// rewrite replaces path's content with edit's.
func rewrite(t *testing.T, path string, edit func([]byte) []byte) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, edit(b), 0o600); err != nil {
		t.Fatal(err)
	}
}

// post posts body to a running agent's path.
func post(t *testing.T, addr, path, body string) {
	t.Helper()
	resp, err := http.Post("http://"+addr+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s %s: %s", path, body, resp.Status)
	}
}

// buildCommit builds gpu-agent as it was at commit, from this clone's
// history (git archive: the clone itself is not touched), with the Go
// module and build caches this build uses. It skips the test where git or
// the commit is missing (a source tarball, a shallow clone).
func buildCommit(t *testing.T, commit string) string {
	t.Helper()
	git, err := exec.LookPath("git")
	if err != nil {
		t.Skipf("needs git to build gpu-agent at %s: %v", commit, err)
	}
	top, err := exec.Command(git, "rev-parse", "--show-toplevel").Output()
	if err != nil {
		t.Skipf("needs a git clone to build gpu-agent at %s: %v", commit, err)
	}
	root := strings.TrimSpace(string(top))
	if err := exec.Command(git, "-C", root, "cat-file", "-e", commit+"^{commit}").Run(); err != nil {
		t.Skipf("commit %s is not in this clone's history (a shallow clone? git fetch --unshallow): %v", commit, err)
	}
	src, err := commitSource(git, root, commit)
	if err != nil {
		t.Fatalf("source of %s: %v", commit, err)
	}
	bin := filepath.Join(t.TempDir(), "gpu-agent-"+commit[:12])
	began := time.Now()
	build := exec.Command("go", "build", "-ldflags", "-X main.version=rollback-base -X main.commit="+commit, "-o", bin, "./cmd/gpu-agent")
	build.Dir = src
	build.Env = append(os.Environ(), "CGO_CFLAGS=-Wno-deprecated-declarations")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build gpu-agent at %s: %v\n%s", commit, err, out)
	}
	t.Logf("built gpu-agent at %s in %v", commit[:12], time.Since(began).Round(time.Millisecond))
	return bin
}

// commitSource is the source tree of commit, extracted once into the user's
// cache directory: a commit's files never change, and the Go build cache
// keys a package on its directory, so a tree in the same place each time
// builds from the cache after the first run (a minute on two cores, then
// seconds). Extracted beside it and renamed, so a run killed mid-way leaves
// no half tree, and two runs at once both end with a whole one.
func commitSource(git, root, commit string) (string, error) {
	cache, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	parent := filepath.Join(cache, "gpu-agent-test")
	src := filepath.Join(parent, "src-"+commit)
	if _, err := os.Stat(filepath.Join(src, "go.mod")); err == nil {
		return src, nil
	}
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(parent, ".src-"+commit+"-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp) // nothing left after the rename
	archive := exec.Command(git, "-C", root, "archive", "--format=tar", commit)
	out, err := archive.StdoutPipe()
	if err != nil {
		return "", err
	}
	var stderr bytes.Buffer
	archive.Stderr = &stderr
	if err := archive.Start(); err != nil {
		return "", err
	}
	if err := untar(out, tmp); err != nil {
		archive.Process.Kill()
		archive.Wait()
		return "", fmt.Errorf("git archive: %w", err)
	}
	if err := archive.Wait(); err != nil {
		return "", fmt.Errorf("git archive: %w\n%s", err, stderr.Bytes())
	}
	if err := os.Rename(tmp, src); err != nil {
		if _, serr := os.Stat(filepath.Join(src, "go.mod")); serr == nil {
			return src, nil // another run's, just as good
		}
		return "", err
	}
	return src, nil
}

// untar writes the regular files and directories of a tar stream under dir.
func untar(r io.Reader, dir string) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		path := filepath.Join(dir, filepath.FromSlash(h.Name))
		if !strings.HasPrefix(path, dir+string(filepath.Separator)) {
			return fmt.Errorf("%q is outside the archive", h.Name)
		}
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(path, 0o755)
		case tar.TypeReg:
			err = writeFrom(path, tr, os.FileMode(h.Mode)&0o777)
		}
		if err != nil {
			return err
		}
	}
}

func writeFrom(path string, r io.Reader, mode os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
