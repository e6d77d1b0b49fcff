package timeslice

import (
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
)

func TestReplicaIDRoundTrip(t *testing.T) {
	tests := []struct {
		id     string
		parent string
		n      int
		ok     bool
	}{
		{"GPU-1234::0", "GPU-1234", 0, true},
		{"MIG-abcd::17", "MIG-abcd", 17, true},
		{"GPU-1234", "", 0, false},
		{"GPU-1234::", "", 0, false},
		{"GPU-1234::-1", "", 0, false},
		{"GPU-1234::01", "", 0, false}, // not what ReplicaID writes
		{"::3", "", 0, false},
		{"GPU-1::2::3", "", 0, false},
	}
	for _, tt := range tests {
		parent, n, ok := Parent(tt.id)
		if parent != tt.parent || n != tt.n || ok != tt.ok {
			t.Errorf("Parent(%q) = %q, %d, %v; want %q, %d, %v", tt.id, parent, n, ok, tt.parent, tt.n, tt.ok)
		}
		if ok && ReplicaID(parent, n) != tt.id {
			t.Errorf("ReplicaID(%q, %d) = %q, want %q", parent, n, ReplicaID(parent, n), tt.id)
		}
	}
}

func gpus(n int) []catalog.Device {
	var out []catalog.Device
	for i := range n {
		id := "GPU-" + string(rune('a'+i))
		out = append(out, catalog.Device{ID: id, Healthy: i != 1, Reason: map[bool]string{true: "XID 48"}[i == 1],
			NUMANode: i / 2, GPU: i, Spec: catalog.AllocateSpec{VisibleID: id}})
	}
	return out
}

func TestExpandInherits(t *testing.T) {
	got := Expand(gpus(2), 3)
	var ids []string
	for _, d := range got {
		ids = append(ids, d.ID)
		parent, _, _ := Parent(d.ID)
		if d.Spec.VisibleID != parent {
			t.Errorf("%s: visible ID %q, want its GPU %q", d.ID, d.Spec.VisibleID, parent)
		}
		if wantHealthy := parent != "GPU-b"; d.Healthy != wantHealthy || (!d.Healthy && d.Reason != "XID 48") {
			t.Errorf("%s: healthy %v reason %q: replicas share their GPU's health", d.ID, d.Healthy, d.Reason)
		}
	}
	want := []string{"GPU-a::0", "GPU-a::1", "GPU-a::2", "GPU-b::0", "GPU-b::1", "GPU-b::2"}
	if !slices.Equal(ids, want) {
		t.Errorf("IDs %v, want %v", ids, want)
	}
}

func TestSelect(t *testing.T) {
	// GPU 4 is in MIG mode: its device is a MIG instance on GPU index 4.
	devs := append(gpus(4), catalog.Device{ID: "MIG-x", GPU: 4, Healthy: true, Spec: catalog.AllocateSpec{VisibleID: "MIG-x"}})
	tests := []struct {
		name    string
		sel     config.ReplicaDevices
		want    []string
		wantErr string
	}{
		{"all", config.ReplicaDevices{All: true}, []string{"GPU-a", "GPU-b", "GPU-c", "GPU-d", "MIG-x"}, ""},
		{"MIG UUID", config.ReplicaDevices{List: []string{"MIG-x"}}, []string{"MIG-x"}, ""},
		{"count", config.ReplicaDevices{Count: 2}, []string{"GPU-a", "GPU-b"}, ""},
		{"indices and UUIDs in list order", config.ReplicaDevices{List: []string{"3", "GPU-a"}}, []string{"GPU-d", "GPU-a"}, ""},
		{"count too large", config.ReplicaDevices{Count: 6}, nil, "6 devices asked for, the node has 5"},
		{"unknown index", config.ReplicaDevices{List: []string{"0", "7"}}, nil, `f[1]: "7" names no device`},
		{"unknown UUID", config.ReplicaDevices{List: []string{"GPU-zz"}}, nil, `f[0]: "GPU-zz"`},
		{"MIG index reference", config.ReplicaDevices{List: []string{"0:1"}}, nil, `f[0]: "0:1": MIG index references are not supported yet`},
		{"index does not name a MIG device", config.ReplicaDevices{List: []string{"4"}}, nil, `f[0]: "4" names no device`},
		{"same GPU twice", config.ReplicaDevices{List: []string{"2", "GPU-c"}}, nil, `f[1]: "GPU-c" selects a device already selected`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Select(tt.sel, devs, "f")
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var ids []string
			for _, d := range got {
				ids = append(ids, d.ID)
			}
			if !slices.Equal(ids, tt.want) {
				t.Errorf("selected %v, want %v", ids, tt.want)
			}
		})
	}
}

// FuzzParent checks replica ID parsing, which reads device IDs the kubelet
// sends: it never panics, and what it accepts is exactly what ReplicaID writes.
func FuzzParent(f *testing.F) {
	for _, s := range []string{"GPU-1::0", "MIG-x::12", "GPU-1", "::", "a::-1", "a::01", "a::b::1", "a::99999999999999999999"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		parent, n, ok := Parent(id)
		if !ok {
			return
		}
		if parent == "" || n < 0 {
			t.Fatalf("Parent(%q) = %q, %d", id, parent, n)
		}
		if ReplicaID(parent, n) != id {
			t.Fatalf("Parent(%q) = %q, %d, which ReplicaID writes as %q", id, parent, n, ReplicaID(parent, n))
		}
	})
}
