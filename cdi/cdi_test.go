package cdi

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// node is a two-GPU inventory: GPU 0 whole, GPU 1 (minor 3) in MIG mode
// with two MIG devices.
func node() *gpu.Inventory {
	return &gpu.Inventory{GPUs: []gpu.GPU{
		{Index: 0, Minor: 0, UUID: "GPU-aaaa"},
		{Index: 1, Minor: 3, UUID: "GPU-bbbb", MIGCapable: true, MIG: gpu.MIGMode{Current: true}, Instances: []gpu.MIGInstance{
			{UUID: "MIG-1111", Profile: "3g.40gb", GI: 1, CI: 0, Index: 0},
			{UUID: "MIG-2222", Profile: "1g.10gb", GI: 9, CI: 0, Index: 1},
		}},
	}}
}

// fakeDev makes a dev root whose nodes are FIFOs: the CDI library takes a
// FIFO for a device node (creating a character device needs root), so it
// resolves them as a runtime does.
func fakeDev(t *testing.T, paths ...string) string {
	t.Helper()
	root := t.TempDir()
	for _, p := range paths {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Mkfifo(full, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func capPath(gpuMinor, gi, ci int) string {
	n, _ := DriverNumbering{}.CapMinor(gpuMinor, gi, ci)
	return "/dev/nvidia-caps/nvidia-cap" + strconv.Itoa(n)
}

// TestSpecResolves writes the node's spec, reads it back through the CDI
// library as a runtime does, and checks that each name NVIDIA's specs use
// gives a container exactly its device nodes plus the control nodes.
func TestSpecResolves(t *testing.T) {
	gi1, ci1 := capPath(3, 1, -1), capPath(3, 1, 0)
	gi9, ci9 := capPath(3, 9, -1), capPath(3, 9, 0)
	root := fakeDev(t, "/dev/nvidia0", "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm", gi1, ci1, gi9, ci9)
	s, err := Build(node(), Host{DevRoot: root, Caps: DriverNumbering{}, Exists: func(p string) bool { _, err := os.Stat(p); return err == nil }})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	w, err := NewWriter(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(NodeSpec, s); err != nil {
		t.Fatal(err)
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	control := []string{"/dev/nvidiactl", "/dev/nvidia-uvm"} // no nvidia-uvm-tools on this host
	tests := []struct {
		name string
		want []string
	}{
		{"GPU-aaaa", []string{"/dev/nvidia0"}},
		{"0", []string{"/dev/nvidia0"}},
		{"GPU-bbbb", []string{"/dev/nvidia3"}},
		{"1", []string{"/dev/nvidia3"}},
		{"MIG-1111", []string{"/dev/nvidia3", gi1, ci1}},
		{"1:0", []string{"/dev/nvidia3", gi1, ci1}},
		{"MIG-2222", []string{"/dev/nvidia3", gi9, ci9}},
		{"1:1", []string{"/dev/nvidia3", gi9, ci9}},
		{"all", []string{"/dev/nvidia0", "/dev/nvidia3", gi1, ci1, gi9, ci9}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := containerDevices(cache, tt.name)
			if err != nil {
				t.Fatal(err)
			}
			if want := sorted(control, tt.want); !slices.Equal(got, want) {
				t.Errorf("container devices %v, want %v", got, want)
			}
		})
	}
}

func TestBuild(t *testing.T) {
	t.Run("no GPUs, no spec", func(t *testing.T) {
		if s, err := Build(&gpu.Inventory{}, Host{}); s != nil || err != nil {
			t.Errorf("got %v, %v; want no spec", s, err)
		}
	})
	t.Run("host paths only under a dev root", func(t *testing.T) {
		s, err := Build(node(), Host{Caps: DriverNumbering{}})
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range s.Devices {
			for _, n := range d.ContainerEdits.DeviceNodes {
				if n.HostPath != "" {
					t.Errorf("%s: host path %s with dev root /", d.Name, n.HostPath)
				}
			}
		}
		if len(s.ContainerEdits.DeviceNodes) != len(ControlNodes) {
			t.Errorf("control nodes %d, want all %d when existence is not checked", len(s.ContainerEdits.DeviceNodes), len(ControlNodes))
		}
	})
	t.Run("MIG device without capabilities", func(t *testing.T) {
		s, err := Build(node(), Host{Caps: MigMinors{}})
		if err == nil || !strings.Contains(err.Error(), "MIG-1111") || !strings.Contains(err.Error(), "gi 1") {
			t.Errorf("error %v, want one naming MIG-1111 and its GI", err)
		}
		// The rest is described all the same.
		var names []string
		for _, d := range s.Devices {
			names = append(names, d.Name)
		}
		if !slices.Equal(names, []string{"GPU-aaaa", "0", "GPU-bbbb", "1", "all"}) {
			t.Errorf("spec devices %v, want the GPUs without the MIG devices", names)
		}
	})
}

// An old-style MIG UUID ("MIG-GPU-<uuid>/<gi>/<ci>", drivers before R470)
// is no CDI device name: it alone is left out and named in the error; the
// device keeps its "<gpu>:<mig>" name and its place in "all", and the rest
// of the spec is written and resolves.
func TestOldStyleMIGUUID(t *testing.T) {
	const old = "MIG-GPU-bbbb/1/0"
	inv := node()
	inv.GPUs[1].Instances[0].UUID = old
	gi1, ci1 := capPath(3, 1, -1), capPath(3, 1, 0)
	gi9, ci9 := capPath(3, 9, -1), capPath(3, 9, 0)
	root := fakeDev(t, "/dev/nvidia0", "/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", gi1, ci1, gi9, ci9)
	s, err := Build(inv, Host{DevRoot: root, Caps: DriverNumbering{}})
	if err == nil || !strings.Contains(err.Error(), `"`+old+`"`) || !strings.Contains(err.Error(), "GPU 1 MIG device 1:0") {
		t.Errorf("error %v, want one naming %s and its device", err, old)
	}
	var names []string
	for _, d := range s.Devices {
		names = append(names, d.Name)
	}
	if want := []string{"GPU-aaaa", "0", "GPU-bbbb", "1", "1:0", "MIG-2222", "1:1", "all"}; !slices.Equal(names, want) {
		t.Errorf("spec devices %v, want %v", names, want)
	}
	dir := t.TempDir()
	w, err := NewWriter(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(NodeSpec, s); err != nil {
		t.Fatalf("the rest of the spec is not written: %v", err)
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	control := []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
	tests := []struct {
		name string
		want []string
	}{
		{"1:0", []string{"/dev/nvidia3", gi1, ci1}},
		{"MIG-2222", []string{"/dev/nvidia3", gi9, ci9}},
		{"all", []string{"/dev/nvidia0", "/dev/nvidia3", gi1, ci1, gi9, ci9}},
	}
	for _, tt := range tests {
		got, err := containerDevices(cache, tt.name)
		if err != nil {
			t.Error(err)
			continue
		}
		if want := sorted(control, tt.want); !slices.Equal(got, want) {
			t.Errorf("%s: container devices %v, want %v", tt.name, got, want)
		}
	}
}

func TestWriter(t *testing.T) {
	dir := t.TempDir()
	w, err := NewWriter(dir)
	if err != nil {
		t.Fatal(err)
	}
	s, err := Build(node(), Host{Caps: DriverNumbering{}})
	if err != nil {
		t.Fatal(err)
	}
	if changed, err := w.Write(NodeSpec, s); !changed || err != nil {
		t.Fatalf("first write: changed %v, %v", changed, err)
	}
	if changed, err := w.Write(NodeSpec, s); changed || err != nil {
		t.Errorf("same spec again: changed %v, %v; want no write", changed, err)
	}
	// Someone removed it: the same content is written again.
	if err := os.Remove(w.Path(NodeSpec)); err != nil {
		t.Fatal(err)
	}
	if changed, err := w.Write(NodeSpec, s); !changed || err != nil {
		t.Errorf("same spec after the file was removed: changed %v, %v; want it written again", changed, err)
	}
	// A new writer (an agent restart) finds the same content on disk.
	w2, _ := NewWriter(dir)
	if changed, err := w2.Write(NodeSpec, s); changed || err != nil {
		t.Errorf("after restart: changed %v, %v; want no write", changed, err)
	}
	fi, err := os.Stat(w.Path(NodeSpec))
	if err != nil || fi.Mode().Perm() != 0o644 {
		t.Errorf("spec file mode %v, %v; want 0644", fi.Mode(), err)
	}
	// Stale: the agent's claim spec goes, another tool's spec stays.
	for _, f := range []string{NodeSpec + "-claim-old.json", "nvidia.yaml", "gpu-agentish.json"} {
		if err := os.WriteFile(filepath.Join(dir, f), []byte("{}"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	removed, err := w.RemoveStale(func(name string) bool { return name == NodeSpec })
	if err != nil || !slices.Equal(removed, []string{NodeSpec + "-claim-old"}) {
		t.Errorf("removed %v, %v; want only the old claim spec", removed, err)
	}
	entries, _ := os.ReadDir(dir)
	var left []string
	for _, e := range entries {
		left = append(left, e.Name())
	}
	if want := []string{"gpu-agent.json", "gpu-agentish.json", "nvidia.yaml"}; !slices.Equal(left, want) {
		t.Errorf("directory holds %v, want %v (no temporary files)", left, want)
	}
	if changed, err := w.Write(NodeSpec, nil); !changed || err != nil {
		t.Errorf("remove: changed %v, %v", changed, err)
	}
	if _, err := os.Stat(w.Path(NodeSpec)); !os.IsNotExist(err) {
		t.Errorf("spec still there after a nil write: %v", err)
	}
}

func TestParseMigMinors(t *testing.T) {
	good := "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\ngpu1/gi2/access 156\ngpu1/gi2/ci1/access 158\n"
	m, err := ParseMigMinors(strings.NewReader(good))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ g, gi, ci, want int }{{0, 0, -1, 3}, {0, 0, 0, 4}, {1, 2, -1, 156}, {1, 2, 1, 158}} {
		if n, ok := m.CapMinor(c.g, c.gi, c.ci); !ok || n != c.want {
			t.Errorf("gpu%d gi%d ci%d: %d %v, want %d", c.g, c.gi, c.ci, n, ok, c.want)
		}
		// The driver's numbering agrees with its table.
		if n, ok := (DriverNumbering{}).CapMinor(c.g, c.gi, c.ci); !ok || n != c.want {
			t.Errorf("driver numbering gpu%d gi%d ci%d: %d, want %d", c.g, c.gi, c.ci, n, c.want)
		}
	}
	for _, bad := range []struct{ in, want string }{
		{"gpu0/gi0/access", "line 1"},
		{"config 1\ngpu0/gi0/access x", "line 2"},
		{"gpu0/gix/access 3", `"gix" is not gi<number>`},
		{"gpu0/gi0/ci0/open 3", "is not gpu<G>"},
		{"gpu-1/gi0/access 3", "gpu<number>"},
		{strings.Repeat("config 1\n", maxMigMinors/9+1), "larger than"},
	} {
		if _, err := ParseMigMinors(strings.NewReader(bad.in)); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%.40q: error %v, want %q", bad.in, err, bad.want)
		}
	}
}

func FuzzParseMigMinors(f *testing.F) {
	f.Add("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n")
	f.Add("gpu7/gi14/ci7/access 1082\n")
	f.Add("gpu0/gi0/ci0/ci0/access 1")
	f.Fuzz(func(t *testing.T, in string) {
		m, err := ParseMigMinors(strings.NewReader(in))
		if err != nil {
			return
		}
		for k, v := range m {
			if k.gpu < 0 || k.gi < 0 || k.ci < -1 || v < 0 {
				t.Fatalf("accepted %+v = %d", k, v)
			}
		}
	})
}

// containerDevices is what a runtime resolving CDI device name through
// cache puts in a container: its device nodes' paths, sorted.
func containerDevices(cache *cdiapi.Cache, name string) ([]string, error) {
	spec := &oci.Spec{Linux: &oci.Linux{}}
	unresolved, err := cache.InjectDevices(spec, QualifiedName(name))
	if err == nil && len(unresolved) > 0 {
		err = fmt.Errorf("unresolved %v", unresolved)
	}
	if err != nil {
		return nil, fmt.Errorf("inject %s: %w", QualifiedName(name), err)
	}
	var got []string
	for _, d := range spec.Linux.Devices {
		got = append(got, d.Path)
	}
	slices.Sort(got)
	return got, nil
}

func sorted(lists ...[]string) []string {
	out := slices.Concat(lists...)
	slices.Sort(out)
	return out
}
