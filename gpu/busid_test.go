package gpu

import (
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

func TestNormalizeBusID(t *testing.T) {
	tests := []struct {
		in, want string
		wantErr  bool
	}{
		{in: "00000000:07:00.0", want: "0000:07:00.0"},
		{in: "00000000:B7:00.0", want: "0000:b7:00.0"},
		{in: "0000:b7:00.0", want: "0000:b7:00.0"},
		{in: "07:00.0", want: "0000:07:00.0"},
		{in: " 00000001:3A:1F.7\n", want: "0001:3a:1f.7"},
		{in: "00010000:01:00.0", want: "10000:01:00.0"}, // VMD domain, as sysfs writes it
		{in: "", wantErr: true},
		{in: "garbage", wantErr: true},
		{in: "0000:07:00", wantErr: true},
		{in: "0000:zz:00.0", wantErr: true},
		{in: "0000:07:20.0", wantErr: true},  // device is 5 bits
		{in: "0000:07:00.8", wantErr: true},  // function is 3 bits
		{in: "0000:107:00.0", wantErr: true}, // bus is 8 bits
		{in: "000000000:07:00.0", wantErr: true},
		{in: "0000:07:00.0:1", wantErr: true},
		{in: "0000::00.0", wantErr: true},
		{in: "0000:+7:00.0", wantErr: true},
	}
	for _, tt := range tests {
		got, err := NormalizeBusID(tt.in)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("NormalizeBusID(%q) = %q, %v; want %q, error %v", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

func FuzzNormalizeBusID(f *testing.F) {
	for _, s := range []string{"00000000:07:00.0", "0000:b7:00.0", "07:00.0", "x"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := NormalizeBusID(s)
		if err != nil {
			return
		}
		// The sysfs form is a fixed point.
		again, err := NormalizeBusID(got)
		if err != nil || again != got {
			t.Errorf("NormalizeBusID(%q) = %q, which normalises to %q, %v", s, got, again, err)
		}
	})
}

func TestPCIBusIDFromPciInfo(t *testing.T) {
	set := func(dst []int8, s string) {
		for i := range s {
			dst[i] = int8(s[i])
		}
	}
	var modern, legacy, empty nvml.PciInfo
	set(modern.BusId[:], "00000000:07:00.0")
	set(modern.BusIdLegacy[:], "0000:99:00.0") // ignored when BusId is set
	set(legacy.BusIdLegacy[:], "0000:08:00.0")

	for _, tt := range []struct {
		name    string
		p       nvml.PciInfo
		want    string
		wantErr bool
	}{
		{"bus id", modern, "0000:07:00.0", false},
		{"legacy only", legacy, "0000:08:00.0", false},
		{"empty", empty, "", true},
	} {
		got, err := pciBusID(tt.p)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("%s: pciBusID = %q, %v; want %q, error %v", tt.name, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestUnionFind(t *testing.T) {
	u := newUnionFind(4)
	s := u.add()
	u.union(0, s)
	u.union(2, s)
	if u.find(0) != u.find(2) || u.find(0) == u.find(1) || u.find(1) == u.find(3) {
		t.Errorf("sets wrong: roots %d %d %d %d", u.find(0), u.find(1), u.find(2), u.find(3))
	}
}

// FuzzPCIeRootOfLink reads any link target as a sysfs device link: the
// answer is an error or one path element naming a root complex.
func FuzzPCIeRootOfLink(f *testing.F) {
	f.Add("../../../devices/pci0000:00/0000:00:01.0/0000:07:00.0")
	f.Add("/sys/devices/pci0001:80/0001:81:00.0")
	f.Add("../../../devices/platform/x")
	f.Add("../../../../../../pcix")
	f.Fuzz(func(t *testing.T, target string) {
		r, err := pcieRootOfLink("/sys", "/sys/bus/pci/devices/0000:07:00.0", target)
		if err != nil {
			return
		}
		if !strings.HasPrefix(r, "pci") || len(r) <= len("pci") || strings.Contains(r, "/") || r == ".." {
			t.Fatalf("root %q of target %q", r, target)
		}
	})
}
