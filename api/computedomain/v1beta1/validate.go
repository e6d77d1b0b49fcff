package v1beta1

import (
	"errors"
	"fmt"

	"k8s.io/apimachinery/pkg/util/validation"
)

// Default fills in what NVIDIA's CRD defaults: allocationMode Single.
func (s *ComputeDomainSpec) Default() {
	if s.Channel != nil && s.Channel.AllocationMode == "" {
		s.Channel.AllocationMode = AllocationModeSingle
	}
}

// Validate checks a spec as NVIDIA's CRD schema does; errors name the
// field ("spec.channel.allocationMode").
func (s ComputeDomainSpec) Validate() error {
	var errs []error
	if s.NumNodes < 0 {
		errs = append(errs, fmt.Errorf("spec.numNodes %d: want 0 or more", s.NumNodes))
	}
	if s.Channel == nil {
		return errors.Join(append(errs, errors.New("spec.channel: required"))...)
	}
	if name := s.Channel.ResourceClaimTemplate.Name; name == "" {
		errs = append(errs, errors.New("spec.channel.resourceClaimTemplate.name: required"))
	} else if msgs := validation.IsDNS1123Subdomain(name); len(msgs) > 0 {
		errs = append(errs, fmt.Errorf("spec.channel.resourceClaimTemplate.name %q: %s", name, msgs[0]))
	}
	if err := s.Channel.AllocationMode.validate(); err != nil {
		errs = append(errs, fmt.Errorf("spec.channel.%w", err))
	}
	return errors.Join(errs...)
}

func (m AllocationMode) validate() error {
	switch m {
	case "", AllocationModeSingle, AllocationModeAll:
		return nil
	}
	return fmt.Errorf("allocationMode %q: want %s or %s", string(m), AllocationModeSingle, AllocationModeAll)
}
