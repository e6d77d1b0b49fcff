package usage

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// statLine is /proc/<pid>/stat of a process named comm started at start
// (clock ticks since boot); fields 3 to 52 as Linux 6.x writes them.
func statLine(pid uint32, comm string, start uint64) string {
	f := strings.Fields("S 1 4012 4012 0 -1 4194560 31337 0 12 0 150 42 0 0 20 0 33 0")
	f = append(f, strconv.FormatUint(start, 10))
	f = append(f, strings.Fields("8450048000 512000 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 17 3 0 0 0 0 0 0 0 0 0 0 0 0 0")...)
	return fmt.Sprintf("%d (%s) %s\n", pid, comm, strings.Join(f, " "))
}

type fakeProc struct {
	t    testing.TB
	root string
}

func (p fakeProc) set(pid uint32, comm string, start uint64, cgroup string) {
	p.t.Helper()
	dir := filepath.Join(p.root, strconv.FormatUint(uint64(pid), 10))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		p.t.Fatal(err)
	}
	for name, data := range map[string]string{"stat": statLine(pid, comm, start), "cgroup": cgroup} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			p.t.Fatal(err)
		}
	}
}

func (p fakeProc) end(pid uint32) {
	if err := os.RemoveAll(filepath.Join(p.root, strconv.FormatUint(uint64(pid), 10))); err != nil {
		p.t.Fatal(err)
	}
}

// TestResolver: owners come from the cgroup, cached per process; a PID
// another process took is read again; an ended process is ErrGone.
func TestResolver(t *testing.T) {
	proc := fakeProc{t, t.TempDir()}
	inPod := "0::/kubepods.slice/kubepods-pod" + uidSD + ".slice/cri-containerd-" + cid + ".scope\n"
	proc.set(4100, "python3", 9000, inPod)
	proc.set(4200, "nv-hostengine", 300, "0::/system.slice/nv-hostengine.service\n")
	r := NewResolver(proc.root)

	tests := []struct {
		pid  uint32
		want Owner
	}{
		{4100, Owner{PodUID: uid, ContainerID: cid, Runtime: "containerd"}},
		{4200, Owner{}},
	}
	for _, tt := range tests {
		if got, err := r.Resolve(tt.pid); err != nil || got != tt.want {
			t.Errorf("pid %d: %+v, %v; want %+v", tt.pid, got, err, tt.want)
		}
	}

	// The same process: from the cache, even if its cgroup file changed.
	proc.set(4100, "python3", 9000, "0::/system.slice/elsewhere.service\n")
	if got, _ := r.Resolve(4100); got.PodUID != uid {
		t.Errorf("same process read again: %+v", got)
	}
	// PID 4100 reused by a process of another pod: a new start time.
	proc.set(4100, "torchrun", 9500, "0::/kubepods/besteffort/pod"+static+"/"+cid2+"\n")
	if got, _ := r.Resolve(4100); got != (Owner{PodUID: static, ContainerID: cid2}) {
		t.Errorf("reused PID: %+v", got)
	}

	proc.end(4200)
	if _, err := r.Resolve(4200); !errors.Is(err, ErrGone) {
		t.Errorf("ended process: %v, want ErrGone", err)
	}
	if _, err := r.Resolve(77); !errors.Is(err, ErrGone) || !strings.Contains(err.Error(), "pid 77") {
		t.Errorf("unknown PID: %v", err)
	}

	r.Retain(func(pid uint32) bool { return pid == 4100 })
	if _, kept := r.cache[4100]; len(r.cache) != 1 || !kept {
		t.Errorf("cache after Retain of 4100: %v", r.cache)
	}
}

func TestResolverRefuses(t *testing.T) {
	proc := fakeProc{t, t.TempDir()}
	proc.set(1, "init", 1, "0::/init.scope\n")
	if err := os.WriteFile(filepath.Join(proc.root, "1", "stat"), []byte("1 (init S 1"), 0o644); err != nil {
		t.Fatal(err)
	}
	proc.set(2, "big", 5, strings.Repeat("0::/x\n", maxProcFile))
	r := NewResolver(proc.root)
	if _, err := r.Resolve(1); err == nil || !strings.Contains(err.Error(), "no command name") {
		t.Errorf("torn stat: %v", err)
	}
	if _, err := r.Resolve(2); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("huge cgroup file: %v", err)
	}
}

func TestParseStartTime(t *testing.T) {
	tests := []struct {
		name string
		stat string
		want uint64
		err  string
	}{
		{"plain", statLine(4100, "python3", 123456), 123456, ""},
		{"command with spaces and parentheses", statLine(4100, "a) (b c) S 9", 77), 77, ""},
		{"empty command", statLine(4100, "", 5), 5, ""},
		{"no command name", "4100 python3 S 1", 0, "no command name"},
		{"too few fields", "4100 (x) S 1 2 3", 0, "fields after the command name"},
		{"not a number", strings.Replace(statLine(4100, "x", 99), " 99 ", " -1 ", 1), 0, "start time"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseStartTime([]byte(tt.stat))
			if got != tt.want || (err == nil) != (tt.err == "") || (err != nil && !strings.Contains(err.Error(), tt.err)) {
				t.Errorf("got %d, %v; want %d, %q", got, err, tt.want, tt.err)
			}
		})
	}
}

// FuzzParseStartTime: any content gives a start time or an error, and a
// stat line written for any command name gives back its start time.
func FuzzParseStartTime(f *testing.F) {
	f.Add([]byte(statLine(1, "systemd", 1)), "comm", uint64(42))
	f.Add([]byte("1 (a)) S"), "))", uint64(0))
	f.Add([]byte(""), "x y", uint64(18446744073709551615))
	f.Fuzz(func(t *testing.T, stat []byte, comm string, start uint64) {
		if _, err := ParseStartTime(stat); err != nil && err.Error() == "" {
			t.Fatal("empty error")
		}
		// The kernel writes at most 15 bytes of the name, any of them.
		if len(comm) > 15 || strings.ContainsAny(comm, "\n") {
			return
		}
		if got, err := ParseStartTime([]byte(statLine(9, comm, start))); err != nil || got != start {
			t.Fatalf("comm %q: %d, %v; want %d", comm, got, err, start)
		}
	})
}

func TestPodIndex(t *testing.T) {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ml", Name: "trainer-0", UID: types.UID(uid)},
		Status: corev1.PodStatus{
			InitContainerStatuses: []corev1.ContainerStatus{{Name: "fetch", ContainerID: "containerd://" + cid2}},
			ContainerStatuses:     []corev1.ContainerStatus{{Name: "train", ContainerID: "containerd://" + cid}, {Name: "starting"}},
		},
	}
	x := NewPodIndex([]*corev1.Pod{pod})
	tests := []struct {
		name string
		o    Owner
		want Workload
		ok   bool
	}{
		{"container", Owner{PodUID: uid, ContainerID: cid, Runtime: "containerd"}, Workload{"ml", "trainer-0", uid, "train"}, true},
		{"init container", Owner{PodUID: uid, ContainerID: cid2}, Workload{"ml", "trainer-0", uid, "fetch"}, true},
		{"container not in the status yet", Owner{PodUID: uid, ContainerID: strings.Repeat("a", 64)}, Workload{"ml", "trainer-0", uid, ""}, true},
		{"another pod", Owner{PodUID: static, ContainerID: cid}, Workload{}, false},
		{"no pod", Owner{ContainerID: cid}, Workload{}, false},
	}
	for _, tt := range tests {
		if got, ok := x.Lookup(tt.o); got != tt.want || ok != tt.ok {
			t.Errorf("%s: %+v, %v; want %+v, %v", tt.name, got, ok, tt.want, tt.ok)
		}
	}
}

// TestResolveSelf reads this test's own process from the real /proc: the
// kernel's stat and cgroup files parse, and a second read is the cached one.
func TestResolveSelf(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc here")
	}
	r := NewResolver("/proc")
	pid := uint32(os.Getpid())
	o, err := r.Resolve(pid)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("this process: %+v", o)
	if _, ok := r.cache[pid]; !ok {
		t.Fatal("not cached")
	}
	if again, err := r.Resolve(pid); err != nil || again != o {
		t.Errorf("second read %+v, %v", again, err)
	}
}

type cgroups map[uint32]string

func (c cgroups) ProcessCgroup(pid uint32) (string, bool) { s, ok := c[pid]; return s, ok }

// TestSimResolver: a simulated process's own cgroup wins; other PIDs are
// read from /proc, or are gone without one.
func TestSimResolver(t *testing.T) {
	const uid = "0b9e4a8c-1d2f-4e3a-9b8c-7d6e5f4a3b2c"
	ctr := strings.Repeat("ab", 32)
	src := cgroups{7: "0::/kubepods/besteffort/pod" + uid + "/" + ctr + "\n"}
	proc := fakeProc{t, t.TempDir()}
	proc.set(8, "python3", 1234, "0::/kubepods/pod"+uid+"/"+strings.Repeat("cd", 32)+"\n")
	r := SimResolver{Src: src, Next: NewResolver(proc.root)}
	if o, err := r.Resolve(7); err != nil || o.PodUID != uid || o.ContainerID != ctr {
		t.Errorf("sim PID: %+v, %v", o, err)
	}
	if o, err := r.Resolve(8); err != nil || o.ContainerID != strings.Repeat("cd", 32) {
		t.Errorf("real PID: %+v, %v", o, err)
	}
	if _, err := r.Resolve(9); !errors.Is(err, ErrGone) {
		t.Errorf("unknown PID: %v, want ErrGone", err)
	}
	if _, err := (SimResolver{Src: src}).Resolve(9); !errors.Is(err, ErrGone) {
		t.Errorf("unknown PID without /proc: %v, want ErrGone", err)
	}
}
