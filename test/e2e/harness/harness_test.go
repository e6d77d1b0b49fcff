package harness

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestParseEnvLog(t *testing.T) {
	tests := []struct {
		name     string
		log      string
		wantEnv  map[string]string
		wantDone bool
		wantErr  bool
	}{
		{
			name: "complete",
			log: "2026-01-01T00:00:00.1Z stdout F PATH=/bin\n" +
				"2026-01-01T00:00:00.1Z stdout F NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b\n" +
				"2026-01-01T00:00:00.1Z stdout F E2E-READY\n",
			wantEnv:  map[string]string{"PATH": "/bin", "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"},
			wantDone: true,
		},
		{
			name:    "not finished yet",
			log:     "2026-01-01T00:00:00.1Z stdout F A=1\n",
			wantEnv: map[string]string{"A": "1"},
		},
		{
			name: "partial lines are joined, stderr ignored, values keep their = signs",
			log: "t stdout P LONG=ab\n" +
				"t stdout F c=d\n" +
				"t stderr F NOT=this\n" +
				"t stdout F EMPTY=\n" +
				"t stdout F E2E-READY\n" +
				"t stdout F AFTER=ignored\n",
			wantEnv:  map[string]string{"LONG": "abc=d", "EMPTY": ""},
			wantDone: true,
		},
		{name: "malformed", log: "garbage\n", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env, done, err := parseEnvLog(strings.NewReader(tt.log))
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			if done != tt.wantDone {
				t.Errorf("done = %v, want %v", done, tt.wantDone)
			}
			if !equalMaps(env, tt.wantEnv) {
				t.Errorf("env = %v, want %v", env, tt.wantEnv)
			}
		})
	}
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

func TestParseTaskList(t *testing.T) {
	out := "TASK    PID     STATUS\n" +
		"abc     100     RUNNING\n" +
		"def     0       STOPPED\n" +
		"ghi     102     RUNNING\n"
	got := parseTaskList(out)
	if len(got) != 2 || !got["abc"] || !got["ghi"] {
		t.Fatalf("parseTaskList = %v, want abc and ghi running", got)
	}
}

func TestParseMountsUnder(t *testing.T) {
	mountinfo := strings.Join([]string{
		"22 1 0:21 / / rw - ext4 /dev/vda rw",
		"30 22 0:30 / /tmp/run rw - tmpfs tmpfs rw",
		"31 30 0:30 /kubelet /tmp/run/kubelet rw - ext4 /dev/vda rw",
		"32 31 0:40 / /tmp/run/kubelet/pods/x/vol\\040a rw - tmpfs tmpfs rw",
		"33 22 0:41 / /tmp/run-other rw - tmpfs tmpfs rw",
		"34 31 0:30 /kubelet /tmp/run/kubelet rw - ext4 /dev/vda rw",
	}, "\n")
	got := parseMountsUnder(mountinfo, "/tmp/run/")
	want := []string{"/tmp/run/kubelet/pods/x/vol a", "/tmp/run/kubelet", "/tmp/run/kubelet", "/tmp/run"}
	if !slices.Equal(got, want) {
		t.Fatalf("parseMountsUnder = %q, want %q (deepest first, stacked mounts twice, siblings excluded)", got, want)
	}
}

func TestUnescapeMountinfo(t *testing.T) {
	tests := map[string]string{
		`/a\040b`:   "/a b",
		`/tab\011x`: "/tab\tx",
		`/plain`:    "/plain",
		`/end\04`:   `/end\04`, // too short to be an escape
		`/bs\134x`:  `/bs\x`,
	}
	for in, want := range tests {
		if got := unescapeMountinfo(in); got != want {
			t.Errorf("unescapeMountinfo(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestWriteDockerArchive(t *testing.T) {
	dst := filepath.Join(t.TempDir(), "img.tar")
	spec := ImageSpec{
		Ref: "example/test:v1",
		Files: []ImageFile{
			{Path: "/bin/tool", Mode: 0o755, Data: []byte("#!binary")},
			{Path: "/bin/alias", Linkname: "tool"},
		},
		Entrypoint: []string{"/bin/tool"},
		Env:        []string{"PATH=/bin"},
	}
	if err := WriteDockerArchive(dst, spec); err != nil {
		t.Fatal(err)
	}
	outer := readTar(t, mustRead(t, dst))
	var manifest []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(outer["manifest.json"].data, &manifest); err != nil {
		t.Fatal(err)
	}
	if len(manifest) != 1 || len(manifest[0].Layers) != 1 || !slices.Equal(manifest[0].RepoTags, []string{spec.Ref}) {
		t.Fatalf("manifest = %+v", manifest)
	}
	var config struct {
		Architecture, OS string
		Config           struct{ Entrypoint, Env []string }
		RootFS           struct {
			Type    string
			DiffIDs []string `json:"diff_ids"`
		}
	}
	configBlob := outer[manifest[0].Config].data
	if err := json.Unmarshal(configBlob, &config); err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256(configBlob); manifest[0].Config != hex.EncodeToString(sum[:])+".json" {
		t.Errorf("config blob name %s is not its digest", manifest[0].Config)
	}
	layer := outer[manifest[0].Layers[0]].data
	sum := sha256.Sum256(layer)
	if want := []string{"sha256:" + hex.EncodeToString(sum[:])}; !slices.Equal(config.RootFS.DiffIDs, want) {
		t.Errorf("diff_ids = %v, want the layer's digest %v", config.RootFS.DiffIDs, want)
	}
	if config.OS != "linux" || !slices.Equal(config.Config.Entrypoint, spec.Entrypoint) || !slices.Equal(config.Config.Env, spec.Env) {
		t.Errorf("config = %+v", config)
	}

	entries := readTar(t, layer)
	if e, ok := entries["bin/"]; !ok || e.hdr.Typeflag != tar.TypeDir {
		t.Errorf("layer lacks the parent directory bin/: %v", keys(entries))
	}
	if e := entries["bin/tool"]; e.hdr == nil || string(e.data) != "#!binary" || e.hdr.Mode != 0o755 {
		t.Errorf("bin/tool = %+v", e)
	}
	if e := entries["bin/alias"]; e.hdr == nil || e.hdr.Typeflag != tar.TypeSymlink || e.hdr.Linkname != "tool" {
		t.Errorf("bin/alias = %+v", e)
	}
}

func TestWriteDockerArchiveRejectsRelativePaths(t *testing.T) {
	err := WriteDockerArchive(filepath.Join(t.TempDir(), "img.tar"), ImageSpec{Ref: "x:y", Files: []ImageFile{{Path: "rel"}}})
	if err == nil {
		t.Fatal("a relative path in an image was accepted")
	}
}

type tarEntry struct {
	hdr  *tar.Header
	data []byte
}

func readTar(t *testing.T, b []byte) map[string]tarEntry {
	t.Helper()
	out := map[string]tarEntry{}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out[hdr.Name] = tarEntry{hdr: hdr, data: data}
	}
}

func keys(m map[string]tarEntry) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func mustRead(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestWriteConfigMapSwapsData(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "cm")
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	if err := writeConfigMap(dir, "config.yaml", "one", t0); err != nil {
		t.Fatal(err)
	}
	key := filepath.Join(dir, "config.yaml")
	if got := string(mustRead(t, key)); got != "one" {
		t.Fatalf("first content = %q", got)
	}
	first, _ := os.Readlink(filepath.Join(dir, "..data"))
	if err := writeConfigMap(dir, "config.yaml", "two", t0.Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	if got := string(mustRead(t, key)); got != "two" {
		t.Fatalf("content after swap = %q", got)
	}
	if target, err := os.Readlink(key); err != nil || target != filepath.Join("..data", "config.yaml") {
		t.Errorf("key is %q (%v), want a symlink through ..data as the kubelet makes it", target, err)
	}
	if _, err := os.Stat(filepath.Join(dir, first)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("old data dir %s still there (err %v)", first, err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 3 { // ..<ts>, ..data, config.yaml
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("dir holds %v, want the data dir, ..data and the key", names)
	}
}

func TestPodManifest(t *testing.T) {
	b, err := podManifest(PodSpec{Name: "p", Limits: map[string]int64{"nvidia.com/gpu": 4}})
	if err != nil {
		t.Fatal(err)
	}
	var pod corev1.Pod
	if err := json.Unmarshal(b, &pod); err != nil {
		t.Fatal(err)
	}
	c := pod.Spec.Containers[0]
	if q := c.Resources.Limits["nvidia.com/gpu"]; q.Value() != 4 {
		t.Errorf("gpu limit = %v, want 4", q.String())
	}
	if c.ImagePullPolicy != corev1.PullNever || !pod.Spec.HostNetwork || pod.Namespace != PodNamespace ||
		pod.Spec.TerminationGracePeriodSeconds == nil || *pod.Spec.TerminationGracePeriodSeconds != 1 {
		t.Errorf("pod spec does not fit a registry-less, CNI-less node: %s", b)
	}
	if pod.Kind != "Pod" || pod.APIVersion != "v1" {
		t.Errorf("kind/apiVersion = %s/%s; the kubelet rejects a static pod without them", pod.Kind, pod.APIVersion)
	}
}

func TestParseCheckpoint(t *testing.T) {
	b := []byte(`{"Data":{"PodDeviceEntries":[{"PodUID":"u1","ContainerName":"main","ResourceName":"nvidia.com/gpu",
		"DeviceIDs":{"0":["GPU-a"]},"AllocResp":"AA=="}],"RegisteredDevices":{"nvidia.com/gpu":["GPU-a","GPU-b"]}},"Checksum":1}`)
	cp, err := parseCheckpoint(b)
	if err != nil {
		t.Fatal(err)
	}
	if got := cp.RegisteredDevices["nvidia.com/gpu"]; !slices.Equal(got, []string{"GPU-a", "GPU-b"}) {
		t.Errorf("registered = %v", got)
	}
	if len(cp.PodDevices) != 1 || cp.PodDevices[0].PodUID != "u1" || !slices.Equal(cp.PodDevices[0].DeviceIDs[0], []string{"GPU-a"}) {
		t.Errorf("pod devices = %+v", cp.PodDevices)
	}
	if _, err := parseCheckpoint([]byte("{")); err == nil {
		t.Error("a truncated checkpoint parsed")
	}
}

func TestProcessStop(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name    string
		argv    []string
		wantErr bool // Stop reports that it had to SIGKILL
	}{
		{name: "exits on SIGTERM", argv: []string{"sleep", "60"}},
		// An ignored signal stays ignored across exec, so this sleep is deaf to SIGTERM.
		{name: "ignores SIGTERM", argv: []string{"sh", "-c", "trap '' TERM; exec sleep 60"}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := startProcess("test", filepath.Join(dir, "log"), nil, tt.argv...)
			if err != nil {
				t.Fatal(err)
			}
			if tt.wantErr {
				waitIgnoresTERM(t, p.PID())
			}
			err = p.Stop(300 * time.Millisecond)
			if (err != nil) != tt.wantErr {
				t.Errorf("Stop = %v, wantErr %v", err, tt.wantErr)
			}
			if done, _ := p.Exited(); !done {
				t.Error("process still running after Stop")
			}
		})
	}
}

// waitIgnoresTERM waits until the process's SigIgn mask has SIGTERM, i.e. the shell has run its trap.
func waitIgnoresTERM(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "SigIgn:"); ok {
				mask, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
				if err == nil && mask&(1<<(uint(syscall.SIGTERM)-1)) != 0 {
					return
				}
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("pid %d never ignored SIGTERM", pid)
}

func TestRecoverLedgerEndsOnlyRecordedProcesses(t *testing.T) {
	base := t.TempDir()
	runDir := filepath.Join(base, "run")
	if err := os.MkdirAll(filepath.Join(runDir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(base, "ledger.json")
	l, err := newLedger(path, runDir)
	if err != nil {
		t.Fatal(err)
	}
	p, err := startProcess("victim", filepath.Join(base, "log"), l, "sleep", "60")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	// A bystander whose PID is in the ledger with another start time stands for PID reuse: it must survive.
	bystander := exec.Command("sleep", "60")
	if err := bystander.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = bystander.Process.Kill(); _ = bystander.Wait() }()
	st, err := procStartTime(bystander.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	l.entry.Procs = append(l.entry.Procs, ledgerPID{PID: bystander.Process.Pid, StartTime: st + 1})
	if err := l.save(); err != nil {
		t.Fatal(err)
	}

	if err := recoverLedger(path, t.Logf); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the recorded process was not ended")
	}
	if err := bystander.Process.Signal(syscall.Signal(0)); err != nil {
		t.Errorf("a process the ledger names with another start time was ended: %v", err)
	}
	if _, err := os.Stat(runDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("run dir not removed: %v", err)
	}
	if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("ledger not removed: %v", err)
	}
	if err := recoverLedger(path, t.Logf); err != nil {
		t.Errorf("recovering without a ledger: %v", err)
	}
}

func TestPoll(t *testing.T) {
	ctx := t.Context()
	n := 0
	if err := poll(ctx, time.Millisecond, func() error {
		n++
		if n < 3 {
			return errors.New("not yet")
		}
		return nil
	}); err != nil || n != 3 {
		t.Fatalf("poll = %v after %d calls, want success after 3", err, n)
	}
	final := errors.New("daemon exited")
	calls := 0
	err := poll(ctx, time.Millisecond, func() error { calls++; return stop(final) })
	if !errors.Is(err, final) || calls != 1 {
		t.Fatalf("poll = %v after %d calls, want the stop error at once", err, calls)
	}
}

func TestContainerLog(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "gpu-agent", Name: "gpu-agent-x", UID: "u1"}}
	tests := []struct {
		name    string
		files   map[string]string // N.log under the container's directory
		want    string
		wantErr bool
	}{
		{
			name:  "one log, both streams, a partial line joined",
			files: map[string]string{"0.log": "t stderr F level=WARN msg=a\nt stdout P b\nt stdout F c\n"},
			want:  "level=WARN msg=a\nbc\n",
		},
		{
			name:  "restarts in order, 10 after 2",
			files: map[string]string{"10.log": "t stderr F third\n", "0.log": "t stderr F first\n", "2.log": "t stderr F second\n"},
			want:  "first\nsecond\nthird\n",
		},
		{name: "no log yet", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := &Env{d: newDirs(t.TempDir())}
			dir := filepath.Join(e.d.podLogs, "gpu-agent_gpu-agent-x_u1", "gpu-agent")
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			for name, text := range tt.files {
				if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			got, err := e.ContainerLog(pod, "gpu-agent")
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tt.wantErr)
			}
			if got != tt.want {
				t.Errorf("log %q, want %q", got, tt.want)
			}
		})
	}
}
