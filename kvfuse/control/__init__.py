"""The loading controller: its policy (`policy`) and the profile it is measured by (`profile`)."""
