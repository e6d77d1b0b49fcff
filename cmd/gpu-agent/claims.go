package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	apiequality "k8s.io/apimachinery/pkg/api/equality"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/dra/schedsim"
)

// claimFiles is config validate's --claims, given once per file.
type claimFiles []string

func (c *claimFiles) String() string { return strings.Join(*c, ",") }

func (c *claimFiles) Set(v string) error {
	if v == "" {
		return errors.New("empty path")
	}
	*c = append(*c, v)
	return nil
}

// readClaimFiles reads every --claims file ("-": standard input, once).
func readClaimFiles(paths []string, stdin io.Reader) (schedsim.Objects, error) {
	var all schedsim.Objects
	readStdin := false
	for _, p := range paths {
		var objs schedsim.Objects
		var err error
		if p == "-" {
			if readStdin {
				return all, errors.New("--claims -: standard input given twice")
			}
			readStdin = true
			objs, err = schedsim.Read(stdin, "standard input")
		} else {
			var f *os.File
			if f, err = os.Open(p); err == nil {
				objs, err = schedsim.Read(f, p)
				f.Close()
			}
		}
		if err != nil {
			return all, fmt.Errorf("--claims: %w", err)
		}
		all.Classes = append(all.Classes, objs.Classes...)
		all.Claims = append(all.Claims, objs.Claims...)
		all.Skipped += objs.Skipped
	}
	return all, nil
}

// claimKind is how a claim fared on the node.
type claimKind int

const (
	claimAllocates  claimKind = iota
	claimMisfit               // it does not fit the node; it may fit another
	claimBroken               // it cannot be evaluated against the node's devices
	claimNotChecked           // what it needs was not given, or not read whole
)

// claimOutcome is what allocating one claim alone on the node gave, for it
// and the claims after it with the same spec (kubectl lists every pod's
// claim made from a template beside the template).
type claimOutcome struct {
	claim   schedsim.Claim
	same    []schedsim.Claim
	kind    claimKind
	devices []string // request: device, where it allocates
	err     error
}

// claimCheck is what checkClaims found.
type claimCheck struct {
	outcomes []claimOutcome
	classes  int      // distinct DeviceClass names
	replaced []string // classes given again with another spec: the later is used
}

// checkClaims allocates each claim alone on the node as pool would publish
// it, with the kube-scheduler's own allocator and the given DeviceClasses
// (the later of a name over the earlier, as kubectl apply would leave it).
func checkClaims(ctx context.Context, nodeName string, pool *devicemodel.Pool, objs schedsim.Objects) claimCheck {
	var check claimCheck
	byName := map[string]schedsim.Class{}
	for _, c := range objs.Classes {
		if old, ok := byName[c.Class.Name]; ok && !apiequality.Semantic.DeepEqual(old.Class.Spec, c.Class.Spec) && !slices.Contains(check.replaced, c.Class.Name) {
			check.replaced = append(check.replaced, c.Class.Name)
		}
		byName[c.Class.Name] = c
	}
	check.classes = len(byName)
	classes := make([]*resourceapi.DeviceClass, 0, len(byName))
	for _, c := range byName {
		classes = append(classes, c.Class)
	}
	node := schedsim.New(nodeName, devicemodel.DriverName, devicemodel.Resources(nodeName, pool, 1, devicemodel.Dropped{}), classes)
	first := map[string]int{} // spec → its outcome
	for _, c := range objs.Claims {
		key, err := json.Marshal(c.Claim.Spec)
		if err == nil {
			if c.Err != nil {
				key = append(key, c.Err.Error()...)
			}
			if i, ok := first[string(key)]; ok {
				check.outcomes[i].same = append(check.outcomes[i].same, c)
				continue
			}
			first[string(key)] = len(check.outcomes)
		}
		check.outcomes = append(check.outcomes, checkClaim(ctx, node, c, byName))
	}
	return check
}

func checkClaim(ctx context.Context, node *schedsim.Node, c schedsim.Claim, classes map[string]schedsim.Class) (o claimOutcome) {
	o = claimOutcome{claim: c}
	if c.Err != nil {
		o.kind, o.err = claimNotChecked, fmt.Errorf("not read whole (a field misspelt, of a later Kubernetes than this build's 1.36, or given twice): %w", c.Err)
		return o
	}
	claim := c.Claim.DeepCopy()
	schedsim.Default(claim)
	if err := schedsim.Validate(claim); err != nil {
		o.kind, o.err = claimBroken, fmt.Errorf("the API server would refuse it: %w", err)
		return o
	}
	var missing []string
	for _, name := range classNames(claim) {
		cl, ok := classes[name]
		switch {
		case !ok:
			missing = append(missing, name)
		case cl.Err != nil:
			o.kind, o.err = claimNotChecked, fmt.Errorf("DeviceClass %s not read whole (a field misspelt, of a later Kubernetes than this build's 1.36, or given twice): %w", name, cl.Err)
			return o
		}
	}
	if len(missing) > 0 {
		o.kind, o.err = claimNotChecked, fmt.Errorf("DeviceClass %s not given: add the cluster's (kubectl get deviceclasses -o yaml) or gpu-agent's (deploy/manifests/dra/deviceclasses.yaml) with another --claims", strings.Join(missing, ", "))
		return o
	}
	defer func() {
		// The allocator trusts the API server's validation, which Validate
		// only approximates: a claim it cannot take is this claim's error,
		// not the end of the check.
		if p := recover(); p != nil {
			o.kind, o.err = claimBroken, fmt.Errorf("the scheduler's allocator failed on it: %v", p)
		}
		node.Release()
	}()
	results, err := node.Allocate(ctx, claim)
	switch {
	case errors.Is(err, schedsim.ErrUnsatisfiable):
		o.kind = claimMisfit
	case err != nil:
		o.kind, o.err = claimBroken, err
	default:
		for _, r := range results {
			for _, d := range r.Devices.Results {
				o.devices = append(o.devices, d.Request+": "+d.Device)
			}
		}
	}
	return o
}

// classNames are the DeviceClasses claim's requests name, sorted, once each.
func classNames(claim *resourceapi.ResourceClaim) []string {
	var names []string
	for _, r := range claim.Spec.Devices.Requests {
		if r.Exactly != nil {
			names = append(names, r.Exactly.DeviceClassName)
		}
		for _, s := range r.FirstAvailable {
			names = append(names, s.DeviceClassName)
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// maxSameNamed is how many claims of one spec a line names beside the first.
const maxSameNamed = 3

// writeClaims prints each claim's outcome (where is the node as checked).
// A claim that cannot be evaluated, or was not checked, is also a warning on
// stderr (counted in the return): the first fails on every node of this
// config, most often by a selector reading an attribute the devices do not
// carry (dra.migDeviceAttributes); the second leaves the check incomplete.
// A claim that does not fit is not: it may fit another node.
func writeClaims(stdout, stderr io.Writer, file, nodeName, where string, objs schedsim.Objects, check claimCheck) int {
	fmt.Fprintf(stdout, "Claims (--claims: %d %s, %d %s", len(objs.Claims), plural(len(objs.Claims), "claim", "claims"), check.classes, plural(check.classes, "DeviceClass", "DeviceClasses"))
	if objs.Skipped > 0 {
		fmt.Fprintf(stdout, ", %d other %s not read", objs.Skipped, plural(objs.Skipped, "object", "objects"))
	}
	fmt.Fprintf(stdout, "), each allocated alone, by the kube-scheduler's allocator, on %s:\n", where)
	for _, name := range check.replaced {
		fmt.Fprintf(stdout, "  DeviceClass %s is given more than once with different specs: the last one given is used\n", name)
	}
	counts := map[claimKind]int{}
	warnings := 0
	for _, o := range check.outcomes {
		counts[o.kind] += 1 + len(o.same)
		var what string
		switch o.kind {
		case claimAllocates:
			what = "allocates " + strings.Join(o.devices, ", ")
			if len(o.devices) == 0 {
				what = "allocates nothing (it has no requests)"
			}
		case claimMisfit:
			what = "does not fit this node"
		case claimBroken:
			what = fmt.Sprintf("CANNOT BE EVALUATED here: %v", o.err)
			fmt.Fprintf(stderr, "warning: %s: on %s: %s cannot be evaluated against the devices this config publishes: %v%s\n", file, nodeName, o.claim, o.err, sameSpec(o.same))
		case claimNotChecked:
			what = fmt.Sprintf("NOT CHECKED: %v", o.err)
			fmt.Fprintf(stderr, "warning: %s: on %s: %s not checked: %v%s\n", file, nodeName, o.claim, o.err, sameSpec(o.same))
		}
		if o.kind == claimBroken || o.kind == claimNotChecked {
			warnings++
		}
		fmt.Fprintf(stdout, "  %s: %s%s\n", o.claim, what, sameSpec(o.same))
	}
	fmt.Fprintf(stdout, "  %d %s, %d %s not fit this node, %d cannot be evaluated, %d not checked\n",
		counts[claimAllocates], plural(counts[claimAllocates], "allocates", "allocate"),
		counts[claimMisfit], plural(counts[claimMisfit], "does", "do"), counts[claimBroken], counts[claimNotChecked])
	return warnings
}

// sameSpec names the claims that share a checked claim's spec.
func sameSpec(same []schedsim.Claim) string {
	if len(same) == 0 {
		return ""
	}
	var names []string
	for _, c := range same[:min(len(same), maxSameNamed)] {
		names = append(names, c.String())
	}
	if len(same) > maxSameNamed {
		names = append(names, fmt.Sprintf("%d more", len(same)-maxSameNamed))
	}
	return fmt.Sprintf(" (and %d with the same spec: %s)", len(same), strings.Join(names, ", "))
}
